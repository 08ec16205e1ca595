"""`MedusaLikeModel.generate` behaves as documented: stop strings given as one string, seeded sampling that repeats,
and calls from several threads."""

import threading

import pytest
import torch

from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.model import MedusaLikeModel

from .conftest import greedy_reference, random_heads, random_prompts, tiny_target
from .test_lookup import flat_cost


class LetterTokenizer:
    """Token t decodes to one letter: stop strings can be matched in the tiny targets' outputs."""

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)


def lookup_model(family: str = "llama") -> MedusaLikeModel:
    """A tiny target with a lookup drafter (context and a store that grows with every remembered answer), its cost
    model given so that no test measures one."""
    model = MedusaLikeModel(tiny_target(family), LetterTokenizer(), LookupDrafter(), backend="sdpa")
    model.drafter.state.cost_model = flat_cost(model.target, per_node_ms=0.5)
    return model


def test_one_stop_string_is_a_string_not_its_letters():
    """`stop_strings="abc"` stops where "abc" first appears in the output, as `["abc"]` does (transformers accepts
    both), not at the first "a", "b" or "c"."""
    model = lookup_model()
    prompt = random_prompts(1, seed=2, min_len=8, max_len=8)[0]
    full = model.generate(prompt, max_new_tokens=40, eos_token_id=[], remember=False)
    text = model.tokenizer.decode(full.new_tokens)
    stop = text[12:15]
    first = text.index(stop) + len(stop)  # the stop string ends after this many tokens (one letter per token)
    as_string = model.generate(prompt, max_new_tokens=40, eos_token_id=[], stop_strings=stop, remember=False)
    as_list = model.generate(prompt, max_new_tokens=40, eos_token_id=[], stop_strings=[stop], remember=False)
    assert as_string.finish_reason == as_list.finish_reason == "stop_string"
    assert as_string.new_tokens.tolist() == as_list.new_tokens.tolist() == full.new_tokens[:first].tolist()


@pytest.mark.parametrize("stop_strings", [5, [b"ab"], ["ab", None]])
def test_stop_strings_that_are_not_strings_are_refused(stop_strings):
    with pytest.raises(TypeError, match="stop_strings"):
        lookup_model().generate(torch.tensor([[1, 2]]), max_new_tokens=4, stop_strings=stop_strings)


@pytest.mark.slow
def test_a_seeded_call_repeats_whatever_the_store_or_tree_holds():
    """The same seeded call at temperature 0.9, three times on one model whose store grows with each answer, gives one
    output, although the later calls draft (and accept) far more from the store; so do plain decoding (no tree) and
    another tree with that seed: the seed alone decides the sample, never the drafts."""
    model = lookup_model()
    store = model.drafter.store
    prompt = random_prompts(1, seed=4, min_len=12, max_len=12)[0]
    kwargs = dict(max_new_tokens=32, temperature=0.9, top_k=20, seed=0, eos_token_id=[])
    outputs = [model.generate(prompt, **kwargs) for _ in range(3)]
    assert len(store) == 3  # every seeded call was remembered: the later calls drafted from a different store
    tokens = outputs[0].new_tokens.tolist()
    assert all(out.new_tokens.tolist() == tokens for out in outputs)
    assert outputs[2].stats.tau > outputs[0].stats.tau  # the store's copies of the answer were drafted and accepted
    assert model.generate(prompt, tree="none", **kwargs).new_tokens.tolist() == tokens
    dynamic = model.generate(prompt, tree={"depth": 3, "top_k": 2, "num_nodes": 5}, **kwargs)
    assert dynamic.new_tokens.tolist() == tokens
    other = model.generate(prompt, **{**kwargs, "seed": 1}).new_tokens.tolist()
    assert other != tokens  # 32 tokens at temperature 0.9: equal only if the seed were ignored
    before = len(store)
    model.generate(prompt, max_new_tokens=8, temperature=0.9, eos_token_id=[])
    assert len(store) == before + 1  # an unseeded call is remembered too


def test_a_seeded_call_repeats_with_a_learned_drafter_on_a_static_tree():
    """Medusa heads on a static tree: the seeded sample equals plain decoding's with the same seed."""
    target = tiny_target("qwen2")
    model = MedusaLikeModel(target, None, random_heads(num_heads=3), backend="sdpa")
    prompt = random_prompts(1, seed=6, min_len=10, max_len=10)[0]
    kwargs = dict(max_new_tokens=24, temperature=0.7, top_p=0.9, seed=123, eos_token_id=[])
    drafted = model.generate(prompt, tree="small", **kwargs)
    assert drafted.new_tokens.tolist() == model.generate(prompt, tree="none", **kwargs).new_tokens.tolist()


@pytest.mark.slow
def test_two_threads_generating_on_one_model_get_the_sequential_outputs():
    """`generate` from two threads at once is serialised: each thread's outputs equal what sequential calls give, and
    none raises (unserialised, the threads interleave their steps on one target and drafter)."""
    model = lookup_model("mistral")
    prompts = random_prompts(2, seed=7, min_len=10, max_len=30)
    references = [greedy_reference(model.target, p, 24).tolist() for p in prompts]
    calls = 4
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def work(index: int):
        try:
            for _ in range(calls):
                out = model.generate(prompts[index], max_new_tokens=24, eos_token_id=[])
                results[index].append(out.new_tokens.tolist())
        except BaseException as err:  # reported below, with the other thread's results
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == {i: [references[i]] * calls for i in (0, 1)}


def test_generate_called_from_its_own_streamer_is_refused():
    """A streamer that calls `generate` on the same model would wait for itself forever: refused instead."""
    model = lookup_model()
    prompt = torch.tensor([[1, 2, 3]])

    def streamer(tokens):
        model.generate(prompt, max_new_tokens=2)

    with pytest.raises(RuntimeError, match="inside"):
        model.generate(prompt, max_new_tokens=4, streamer=streamer)
    assert model.generate(prompt, max_new_tokens=4, eos_token_id=[]).new_tokens.numel() == 4
