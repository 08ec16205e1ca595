"""`MedusaLikeModel.generate` behaves as documented: stop strings given as one string, seeded sampling that repeats,
and calls from several threads."""

import contextlib
import threading

import pytest
import torch

from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.model import MedusaLikeModel

from .conftest import random_heads, random_prompts, stock_greedy, tiny_target, untouched_target
from .test_lookup import flat_cost


class LetterTokenizer:
    """Token t decodes to one letter: stop strings can be matched in the tiny targets' outputs."""

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)


def lookup_model(family: str = "llama", per_node_ms: float = 0.5, tuned_layers: bool | None = None) -> MedusaLikeModel:
    """A tiny target with a lookup drafter (context and a store that grows with every remembered answer), its cost
    model given so that no test measures one."""
    model = MedusaLikeModel(
        tiny_target(family), LetterTokenizer(), LookupDrafter(), backend="sdpa", tuned_layers=tuned_layers
    )
    model.drafter.state.cost_model = flat_cost(model.target, per_node_ms=per_node_ms)
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


# ---------------------------------------------------------------------------------------------------------------------
# Calls from two threads


class Turns:
    """Two threads' proposer calls in strict alternation (thread 0's, then thread 1's, ...) while both generate, so
    that generations which are not serialised interleave the same way in every run. A thread waiting for its turn
    while the other is held at the model's lock (`held`, told by `WatchedLock`) ends the alternation: serialised calls
    then run one after the other. Every wait ends on an event, none on a timeout."""

    def __init__(self):
        self.changed = threading.Condition()
        self.turn, self.off = 0, False
        self.held: set[int] = set()  # the threads waiting at the model's lock

    @contextlib.contextmanager
    def take(self, who: int):
        with self.changed:
            self.changed.wait_for(lambda: self.off or self.turn == who or (1 - who) in self.held)
            self.off |= self.turn != who  # the other thread cannot take its turn: no more alternation
        try:
            yield
        finally:
            with self.changed:
                self.turn = 1 - who
                self.changed.notify_all()

    def hold(self, who: int, waiting: bool) -> None:
        with self.changed:
            (self.held.add if waiting else self.held.discard)(who)
            self.changed.notify_all()

    def leave(self) -> None:
        """A thread with nothing left to do: the other runs freely."""
        with self.changed:
            self.off = True
            self.changed.notify_all()


class WatchedLock:
    """The model's lock (`MedusaLikeModel._lock`, a `threading.Lock`), locking as it does, that tells `turns` while
    the calling thread (`who()`) waits at it."""

    def __init__(self, lock, turns: Turns, who):
        self.lock, self.turns, self.who = lock, turns, who

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.turns.hold(self.who(), True)
            self.lock.acquire()
            self.turns.hold(self.who(), False)
        return self

    def __exit__(self, *exc) -> None:
        self.lock.release()


class RecordingProposer:
    """One generation's proposer, wrapped: its record joins `records` when it begins, every tree it proposes is
    recorded, and each call takes its turn."""

    def __init__(self, inner, records: list, record: dict, turns: Turns | None, who: int):
        self.inner, self.records, self.record, self.turns, self.who = inner, records, record, turns, who

    def __getattr__(self, name):  # feature_layers, max_depth, max_rank
        return getattr(self.inner, name)

    def _turn(self):
        return self.turns.take(self.who) if self.turns else contextlib.nullcontext()

    def begin(self, *args) -> None:
        with self._turn():
            self.records.append(self.record)
            self.inner.begin(*args)

    def propose(self, spec):
        with self._turn():
            tree = self.inner.propose(spec)
        self.record["drafts"].append(tree.tokens.tolist())
        return tree

    def accept(self, *args) -> None:
        with self._turn():
            self.inner.accept(*args)


class Recorded:
    """`model`'s generations, each recorded ({prompt, drafts per step, accepted_draft, tokens}) in the order they
    began: `generate(i)` asks for prompt i from the calling thread."""

    def __init__(self, model: MedusaLikeModel, prompts: list, turns: Turns | None = None):
        self.model, self.prompts, self.records, self.local = model, prompts, [], threading.local()
        make = model.drafter.proposer

        def proposer(target):  # called inside `generate`, once per generation
            record = self.local.record = {"prompt": self.local.prompt, "drafts": []}
            return RecordingProposer(make(target), self.records, record, turns, self.local.prompt)

        model.drafter.proposer = proposer

    def generate(self, i: int) -> None:
        self.local.prompt = i
        out = self.model.generate(self.prompts[i], max_new_tokens=24, eos_token_id=[])  # remembered: the store grows
        self.local.record.update(accepted=out.stats.accepted_draft, tokens=out.new_tokens.tolist())


@pytest.mark.slow
@pytest.mark.parametrize("serialised", [True, False])
def test_two_threads_generating_on_one_model_draft_what_sequential_calls_draft(monkeypatch, serialised):
    """`generate` from two threads at once is serialised: every call proposes the same trees, accepts the same drafts
    and returns the same tokens as the same calls made one after another in the order they were served. A lookup
    drafter's context index, calibration and output store are shared by every generation on the model, so drafts
    tell interleaved generations apart where outputs cannot (they equal greedy's whatever the drafts).

    Negative control (`serialised=False`): the model's serialisation removed and the threads' proposer calls made to
    alternate, the comparison catches the two generations' steps interleaving in the shared calibration, every run
    (each proposer indexes its own context, so that one is not shared)."""
    # nn.Linear layers and a flat cost model: trees depend on the drafter's state alone, not on timings
    model = lookup_model("mistral", per_node_ms=0.0, tuned_layers=False)
    prompts = random_prompts(2, seed=7, min_len=10, max_len=30)
    if not serialised:
        monkeypatch.setattr(model, "_one_generation", contextlib.nullcontext)
    turns = Turns()
    threaded = Recorded(model, prompts, turns)
    model._lock = WatchedLock(model._lock, turns, lambda: threaded.local.prompt)
    errors: list[BaseException] = []

    def work(i: int):
        try:
            for _ in range(3):
                threaded.generate(i)
        except BaseException as err:  # reported below, with the other thread's records
            errors.append(err)
        finally:
            turns.leave()

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    served = [record["prompt"] for record in threaded.records]
    sequential = Recorded(lookup_model("mistral", per_node_ms=0.0, tuned_layers=False), prompts)
    for i in served:
        sequential.generate(i)
    if serialised:
        assert errors == [] and sorted(served) == [0, 0, 0, 1, 1, 1]
        assert threaded.records == sequential.records
        references = stock_greedy(untouched_target("mistral"), prompts, 24)
        assert all(record["tokens"] == references[record["prompt"]] for record in threaded.records)
        assert any(sum(record["accepted"]) for record in threaded.records)  # drafts were accepted: they mattered
        return
    # both first calls began before either proposed, and their steps alternate: each generation's calibration
    # (shared by the drafter's proposers) takes in the other's acceptances, so their trees differ from sequential ones
    assert served[:2] == [0, 1]
    assert threaded.records != sequential.records


def test_generate_called_from_its_own_streamer_is_refused():
    """A streamer that calls `generate` on the same model would wait for itself forever: refused instead."""
    model = lookup_model()
    prompt = torch.tensor([[1, 2, 3]])

    def streamer(tokens):
        model.generate(prompt, max_new_tokens=2)

    with pytest.raises(RuntimeError, match="inside"):
        model.generate(prompt, max_new_tokens=4, streamer=streamer)
    assert model.generate(prompt, max_new_tokens=4, eos_token_id=[]).new_tokens.numel() == 4
