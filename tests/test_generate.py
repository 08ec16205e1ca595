"""Losslessness of tree speculative decoding on tiny random targets of four families, three backends, four trees."""

import json
from functools import cache

import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer

from medusa_like.decoding.generate import StopChecker, accept_greedy, speculative_generate
from medusa_like.decoding.kv_cache import CacheOverflowError
from medusa_like.decoding.projection import VocabProjection
from medusa_like.decoding.step import EagerStep
from medusa_like.decoding.tree import DynamicTreeSpec, TokenTree
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.base import DrafterMismatchError
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import load_target

from .conftest import (
    VOCAB,
    OracleProposer,
    ScriptedProposer,
    assert_greedy_or_near_tie,
    greedy_reference,
    random_heads,
    random_prompts,
    stock_greedy,
    tiny_target,
    untouched_target,
)

BACKENDS = ["eager", "sdpa", "flash"]
TREES = ["chain", "small", "medusa"]
NEW_TOKENS = 24

_references: dict = {}


def references(family: str) -> tuple:
    """A tiny target of `family` to decode with, a new object for each test (decoding swaps its layers in place, so a
    shared one would make a later reference depend on the tests before it); 20 prompts of varied lengths; and
    transformers' own greedy continuations of an untouched copy (`stock_greedy`), computed once per family."""
    if family not in _references:
        prompts = random_prompts(20, seed=1, min_len=1, max_len=40)
        continuations = stock_greedy(untouched_target(family), prompts, NEW_TOKENS)
        _references[family] = prompts, [torch.tensor(tokens) for tokens in continuations]
    prompts, expected = _references[family]
    return tiny_target(family), prompts, expected


@cache
def truth(family: str, index: int, n: int = 60) -> tuple[int, ...]:
    """transformers' greedy continuation of `references(family)` prompt `index` on an untouched copy, `n` tokens."""
    _, prompts, _ = references(family)
    return tuple(stock_greedy(untouched_target(family), [prompts[index]], n)[0])


@pytest.mark.slow
@pytest.mark.parametrize("tree_name", TREES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_greedy_equals_target_greedy(family, backend, tree_name):
    """Random heads (their guesses are sometimes right on these repetitive tiny models): the output is the target's
    greedy output, and the matrix exercises accepted drafts, not only the all-rejected path."""
    target, prompts, expected = references(family)
    model = MedusaLikeModel(target, None, random_heads(), backend=backend)
    accepted = 0
    for prompt, reference in zip(prompts, expected, strict=True):
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree=tree_name, eos_token_id=[])
        assert out.new_tokens.tolist() == reference.tolist(), f"prompt of length {prompt.shape[1]}"
        assert out.stats.new_tokens == NEW_TOKENS
        accepted += sum(out.stats.accepted_draft)
    assert accepted > 0, "no draft token was ever accepted: only the all-rejected path was tested"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_decoding_equals_target_greedy(family, backend):
    """tree='none' never calls the drafter: one prefill and one target forward per token, the target's greedy output."""
    target, prompts, expected = references(family)
    model = MedusaLikeModel(target, None, random_heads(), backend=backend)
    for prompt, reference in zip(prompts[:5], expected[:5], strict=True):
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree="none", eos_token_id=[])
        assert out.new_tokens.tolist() == reference.tolist(), f"prompt of length {prompt.shape[1]}"
        assert out.stats.accepted_draft == [0] * (NEW_TOKENS - 1)


@pytest.mark.parametrize("tree_name", ["chain", "small", "medusa"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_tree_node_sees_exactly_its_path(family, backend, tree_name):
    """The logits at each node equal those of running the prompt + that node's path sequentially."""
    target = tiny_target(family)
    tree = resolve_tree(tree_name, 4)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (1, 11), generator=g)
    tokens = torch.randint(0, VOCAB, (tree.num_nodes,), generator=g)
    step = EagerStep(target, backend)
    cache = step.new_cache(64 + tree.num_nodes)
    with torch.no_grad():
        step.forward(prompt, torch.arange(11)[None], None, cache, last=True)
        cache.commit_all(11)
        tree_logits, _ = step.forward(tokens[None], (11 + tree.depth)[None], tree.attention_mask[None, None], cache)
    for node in range(tree.num_nodes):
        ancestors = tree.attention_mask[node].nonzero().flatten()  # ascending = root to node
        sequence = torch.cat([prompt[0], tokens[ancestors]])[None]
        with torch.no_grad():
            expected = target(sequence).logits[0, -1]
        torch.testing.assert_close(tree_logits[node], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tree_name", ["chain", "small", "medusa"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_oracle_candidates_accept_full_depth_every_step(family, backend, tree_name):
    """When rank 0 of every head is the target's own continuation, every step accepts depth + 1 tokens."""
    target, prompts, _ = references(family)
    tree = resolve_tree(tree_name, 4)
    prompt = prompts[0]
    continuation = truth(family, 0)
    g = torch.Generator().manual_seed(0)

    def oracle(generated):
        proposals = torch.randint(0, VOCAB, (4, tree.top_k), generator=g)
        for k in range(4):  # head k+1 guesses the token k+1 after the root
            index = len(generated) + k
            proposals[k, 0] = continuation[index] if index < len(continuation) else 0
        # ranks > 0 must not repeat the right token, or a sibling could be accepted instead; harmless either way
        return proposals

    out = speculative_generate(target, ScriptedProposer(oracle), prompt, tree, max_new_tokens=40, backend=backend)
    assert out.new_tokens.tolist() == list(continuation[:40])
    assert out.stats.accepted_draft == [tree.max_depth] * len(out.stats.accepted_draft)
    steps = len(out.stats.accepted_draft)
    assert steps == -(-(40 - 1) // (tree.max_depth + 1))  # ceil: the prefill yields the first token
    assert out.stats.tau == pytest.approx(40 / (steps + 1))


@pytest.mark.parametrize("spec", [DynamicTreeSpec(4, 4, 12), DynamicTreeSpec(6, 2, 8), "small"])
def test_oracle_drafter_accepts_full_depth_on_dynamic_trees(family, spec):
    """A drafter that knows the continuation gets its whole chain accepted every step, static or dynamic tree."""
    target, prompts, _ = references(family)
    continuation = list(truth(family, 1))
    tree = resolve_tree(spec, None)
    out = speculative_generate(target, OracleProposer(continuation), prompts[1], tree, max_new_tokens=40)
    assert out.new_tokens.tolist() == continuation[:40]
    assert out.stats.accepted_draft[:-1] == [tree.max_depth] * (len(out.stats.accepted_draft) - 1)


def test_untrained_heads_are_lossless_and_reproduce_the_base_distribution():
    target = tiny_target("llama")
    model = MedusaLikeModel.from_pretrained(target, drafter="medusa", num_heads=3)
    prompt = random_prompts(1, seed=5)[0]
    hidden = target.base_model(prompt).last_hidden_state[0, -1]
    head_logits = model.drafter(hidden, target.get_output_embeddings())  # [3, V]
    base_logits = target.get_output_embeddings()(hidden)
    for k in range(3):
        torch.testing.assert_close(head_logits[k], base_logits)
    out = model.generate(prompt, max_new_tokens=20, tree="small", eos_token_id=[])
    assert out.new_tokens.tolist() == stock_greedy(untouched_target("llama"), [prompt], 20)[0]


def test_eos_stops_like_the_target():
    target, prompts, expected = references("llama")
    prompt, reference = prompts[2], expected[2]
    eos = int(reference[7])
    model = MedusaLikeModel(target, None, random_heads(), backend="sdpa")
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree="small", eos_token_id=eos)
    hf = untouched_target("llama").generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
    )[0, prompt.shape[1] :]
    assert out.new_tokens.tolist() == hf.tolist()
    assert out.new_tokens[-1] == eos and out.finish_reason == "eos"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 17])
def test_max_new_tokens_is_exact(max_new_tokens):
    target, prompts, expected = references("llama")
    model = MedusaLikeModel(target, None, random_heads(), backend="sdpa")
    out = model.generate(prompts[3], max_new_tokens=max_new_tokens, tree="medusa", eos_token_id=[])
    assert out.new_tokens.tolist() == expected[3][:max_new_tokens].tolist()
    assert out.finish_reason == "length"
    assert out.sequences.shape[1] == prompts[3].shape[1] + max_new_tokens


def test_streaming_callback_sees_every_token_once():
    target, prompts, expected = references("qwen2")
    model = MedusaLikeModel(target, None, random_heads(), backend="sdpa")
    streamed: list[int] = []
    out = model.generate(prompts[4], max_new_tokens=NEW_TOKENS, tree="chain", eos_token_id=[], streamer=streamed.extend)
    assert streamed == out.new_tokens.tolist() == expected[4].tolist()


def test_accept_greedy_picks_the_longest_matching_path():
    tree = TokenTree.from_paths([[0], [1], [0, 0], [1, 0], [1, 0, 0]])
    # nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [1,0], 5 [1,0,0]
    tokens = torch.tensor([7, 10, 11, 12, 13, 14])
    predictions = torch.tensor([11, 12, 13, 99, 14, 15])  # root->11 (node 2), node 2->13 (node 4), node 4->14 (node 5)
    assert accept_greedy(tokens, predictions, tree).tolist() == [0, 2, 4, 5]
    predictions = torch.tensor([10, 12, 0, 0, 0, 0])  # root->10 (node 1), node 1->12 (node 3)
    assert accept_greedy(tokens, predictions, tree).tolist() == [0, 1, 3]
    predictions = torch.tensor([42, 0, 0, 0, 0, 0])  # nothing matches: the root alone
    assert accept_greedy(tokens, predictions, tree).tolist() == [0]


def test_stop_checker_cuts_at_eos_and_stop_strings():
    class CharTokenizer:
        def decode(self, ids):
            return "".join(chr(ord("a") + i) for i in ids)

    stop = StopChecker([25], ["cd"], CharTokenizer())
    assert stop.cut([0, 1, 2, 3, 4], 0) == (4, "stop_string")
    assert stop.cut([0, 25, 2, 3], 0) == (2, "eos")
    assert stop.cut([0, 1, 4], 0) is None
    with pytest.raises(ValueError, match="need a tokenizer"):
        StopChecker([], ["x"], None)


def test_bad_requests_get_clear_errors():
    target = tiny_target("llama")
    model = MedusaLikeModel(target, None, random_heads(num_heads=2), backend="sdpa")
    prompt = random_prompts(1)[0]
    with pytest.raises(ValueError, match="one sequence"):
        model.generate(torch.zeros(2, 5, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        model.generate(prompt, max_new_tokens=0)
    with pytest.raises(ValueError, match="tree has depth 3 but the drafter drafts at most 2 deep"):
        model.generate(prompt, max_new_tokens=4, tree=[[0], [0, 0], [0, 0, 0]])
    with pytest.raises(CacheOverflowError, match="too small"):
        model.generate(prompt, max_new_tokens=50, max_cache_len=prompt.shape[1] + 10)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(prompt, max_new_tokens=600)
    with pytest.raises(ValueError, match="empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 97\)"):
        model.generate(torch.tensor([[3, VOCAB]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        model.generate(prompt, max_new_tokens=4, temperature=1.0, top_k=-1)
    with pytest.raises(DrafterMismatchError, match="hidden size 32, but target .* hidden size 48"):
        MedusaLikeModel(tiny_target("llama", hidden_size=48, head_dim=12), None, random_heads())


def test_sliding_window_matters_in_these_tests():
    """Negative control: the windowed families' greedy output changes without the window, so the tests above check
    that tree tokens get the window."""
    windowed = tiny_target("mistral")
    unwindowed = tiny_target("mistral", sliding_window=4096)
    prompt = random_prompts(1, seed=9, min_len=30, max_len=30)[0]
    assert greedy_reference(windowed, prompt, 16).tolist() != greedy_reference(unwindowed, prompt, 16).tolist()


def test_vocab_projection_gives_the_targets_own_logits(family):
    """The projection used for verification and for the heads equals the target's logits, soft-capping included."""
    target = tiny_target(family)
    if family == "gemma3":
        target.config.final_logit_softcapping = 0.5  # small enough to change the logits a lot
    prompt = random_prompts(1, seed=6)[0]
    with torch.no_grad():
        hidden = target.base_model(prompt).last_hidden_state
        expected = target(prompt).logits
    torch.testing.assert_close(VocabProjection(target)(hidden), expected, atol=1e-5, rtol=1e-5)


class RecordingProposer:
    """Passes everything to `inner` and records the tokens of every proposed tree (the root excluded)."""

    def __init__(self, inner):
        self.inner, self.proposed = inner, set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, spec):
        tree = self.inner.propose(spec)
        self.proposed |= set(tree.tokens[1:].tolist())
        return tree


@pytest.mark.slow
@pytest.mark.parametrize("tree_name", ["small", "dynamic"])
def test_heads_on_a_reduced_vocabulary_propose_only_its_tokens_and_stay_lossless(family, tree_name):
    """Medusa heads restricted to a draft vocabulary (FR-Spec) never propose a token outside it, and the output is still
    the target's own greedy output (verification always scores the full vocabulary)."""
    target, prompts, expected = references(family)
    vocab = DraftVocab(torch.arange(0, VOCAB, 3), VOCAB)
    heads = random_heads()
    heads.draft_vocab = vocab
    model = MedusaLikeModel(target, None, heads, backend="sdpa")
    tree = model.resolve_tree(tree_name)
    proposed = set()
    for prompt, reference in zip(prompts[:8], expected[:8], strict=True):
        proposer = RecordingProposer(model.proposer())
        out = speculative_generate(target, proposer, prompt, tree, NEW_TOKENS, backend="sdpa")
        assert out.new_tokens.tolist() == reference.tolist()
        proposed |= proposer.proposed
    assert proposed and proposed <= set(vocab.token_ids.tolist())


@pytest.mark.slow
def test_a_tree_given_as_a_dict_or_a_json_file_is_that_tree(tmp_path):
    """A dict of `DynamicTreeSpec` fields, a JSON file of rank paths and a JSON file of a dynamic spec each decode
    exactly as the spec they describe (the same accepted drafts step by step), and losslessly."""
    target, prompts, expected = references("llama")
    model = MedusaLikeModel(target, None, random_heads(), backend="sdpa")
    paths = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    static_file = tmp_path / "static.json"
    static_file.write_text(json.dumps({"paths": paths}))
    dynamic_file = tmp_path / "dynamic.json"
    dynamic_file.write_text(json.dumps({"dynamic": {"depth": 3, "top_k": 3, "num_nodes": 8}}))
    cases = [
        ({"depth": 3, "top_k": 3, "num_nodes": 8}, DynamicTreeSpec(depth=3, top_k=3, num_nodes=8)),
        (str(dynamic_file), DynamicTreeSpec(depth=3, top_k=3, num_nodes=8)),
        (static_file, paths),
    ]
    for given, meant in cases:
        for prompt, reference in zip(prompts[:3], expected[:3], strict=True):
            got = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree=given, eos_token_id=[])
            want = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree=meant, eos_token_id=[])
            assert got.new_tokens.tolist() == reference.tolist()
            assert got.stats.accepted_draft == want.stats.accepted_draft, given
    assert model.resolve_tree(static_file).num_nodes == len(paths) + 1


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from medusa_like.targets import DEFAULT_TARGET, resolve_target

    return AutoTokenizer.from_pretrained(resolve_target(DEFAULT_TARGET))


def test_transformers_streamers_receive_what_transformers_generate_gives_them(tokenizer):
    """A transformers streamer gets the prompt, then the generated ids in order, once each, then `end`: the ids
    transformers' own greedy `generate` puts into it, so that `skip_prompt=True` drops the prompt and nothing else;
    TextIteratorStreamer yields the same text as from transformers."""
    target, prompts, expected = references("qwen2")  # ids < 97 are valid ids of the default's tokenizer
    model = MedusaLikeModel(target, tokenizer, random_heads(), backend="sdpa")

    class Recording(TextStreamer):
        def __init__(self, skip_prompt):
            super().__init__(tokenizer, skip_prompt=skip_prompt)
            self.ids, self.text, self.ended = [], [], False

        def put(self, value):
            self.ids += value.flatten().tolist()
            super().put(value)

        def on_finalized_text(self, text, stream_end=False):
            self.text.append(text)
            self.ended |= stream_end

    prompt = prompts[5].reshape(1, -1)  # [1, T]
    ours, theirs = Recording(skip_prompt=True), Recording(skip_prompt=True)
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, tree="small", eos_token_id=[], streamer=ours)
    untouched_target("qwen2").generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                       streamer=theirs, attention_mask=torch.ones_like(prompt))  # fmt: skip
    assert out.new_tokens.tolist() == expected[5].tolist()
    assert ours.ids == theirs.ids == prompt[0].tolist() + expected[5].tolist()
    assert ours.ended and "".join(ours.text) == "".join(theirs.text) == tokenizer.decode(expected[5])

    for skip_prompt in (True, False):
        iterator = TextIteratorStreamer(tokenizer, skip_prompt=skip_prompt)
        out = model.generate(prompts[6], max_new_tokens=NEW_TOKENS, tree="dynamic", eos_token_id=[], streamer=iterator)
        shown = expected[6].tolist() if skip_prompt else prompts[6].flatten().tolist() + expected[6].tolist()
        assert "".join(iterator) == tokenizer.decode(shown) and out.new_tokens.tolist() == expected[6].tolist()


@pytest.mark.slow
def test_from_pretrained_loads_the_target_in_the_dtype_and_on_the_device_asked(tmp_path, tokenizer):
    """A target directory loaded with `dtype=` (a torch dtype or its name) and `device=`: target and drafter get them,
    and decoding gives transformers' own greedy tokens of the same files loaded again (up to a near-tie: two forwards
    in these precisions round apart)."""
    saved = tiny_target("llama")
    saved.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    prompt = random_prompts(1, seed=8)[0]
    for dtype in (torch.bfloat16, "float16"):
        model = MedusaLikeModel.from_pretrained(
            str(tmp_path / "target"), dtype=dtype, device="cpu", drafter="medusa", num_heads=2
        )
        want = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        assert model.target.dtype == want and model.device == torch.device("cpu")
        assert {p.dtype for p in model.drafter.parameters()} == {want}
        out = model.generate(prompt, max_new_tokens=12, tree="small", eos_token_id=[])
        untouched = load_target(str(tmp_path / "target"), dtype=dtype, device="cpu")[0]  # loaded again: stock layers
        reference = stock_greedy(untouched, [prompt], 12)[0]
        assert_greedy_or_near_tie(untouched, prompt, out.new_tokens.tolist(), reference)
    with torch.no_grad():  # the weights are the saved ones, rounded
        loaded = model.target.get_input_embeddings().weight.float()
        torch.testing.assert_close(loaded, saved.get_input_embeddings().weight, atol=1e-2, rtol=1e-2)
