"""Lookup drafting and the combined tree: the n-gram index, the output store, merging, scoring, the cost-aware
budget, the cost model's files, and losslessness of every source alone and combined on every family and backend."""

import dataclasses
import itertools
import json

import pytest
import torch

from medusa_like.decoding.cost_model import BatchShare, CostModel, non_decreasing_fit
from medusa_like.decoding.tree import BudgetedTreeSpec, DynamicTreeSpec, TokenTree
from medusa_like.decoding.tree_files import spec_from_json
from medusa_like.drafters.base import DrafterMismatchError
from medusa_like.drafters.budget import best_rate, lookup_certainty
from medusa_like.drafters.combined import CombinedDrafter
from medusa_like.drafters.eagle3 import EAGLE3
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.drafters.lookup_sources import OutputStore
from medusa_like.drafters.merged_tree import PROBE_EVERY, MergedTreeProposer, SessionState
from medusa_like.drafters.ngram_index import SEPARATOR, Continuation, NgramIndex
from medusa_like.drafters.protocol import sized_by_cost_model
from medusa_like.forward import MachineProfile, ProfileMismatchError, prepare_target, write_profile
from medusa_like.forward.cost_measure import measure_cost_model
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import weights_fingerprint

from .conftest import FAMILIES, flat_cost, random_heads, random_prompts, stock_greedy, tiny_target, untouched_target

BACKENDS = ("eager", "sdpa", "flash")


# ---------------------------------------------------------------------------------------------------------------------
# The n-gram index


def test_index_finds_the_longest_suffix_and_every_continuation_as_a_branch():
    index = NgramIndex(max_n=3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3])
    found = {c.path: c for c in index.continuations([8, 2, 3], depth=2)}
    # "2 3" occurred twice before the end: followed by "4 9" and by "5 7"
    assert set(found) == {(4,), (4, 9), (5,), (5, 7)}
    assert found[(4,)].frequency == pytest.approx(0.5) and found[(4, 9)].frequency == pytest.approx(1.0)
    assert found[(4,)].match_length == 2
    # the 3-gram "9 2 3" matches once: only its continuation is drafted; compared backwards, "4 9 2 3" agrees: 4
    longest = index.continuations([4, 9, 2, 3], depth=1)
    assert [(c.path, c.match_length) for c in longest] == [((5,), 4)]


def test_index_matches_a_scan_of_the_sequence_however_it_was_extended():
    """The recent occurrences of every n-gram agree with a brute-force scan, whether the tokens came in one piece
    or in chunks whose n-grams straddle the chunks; none crosses a SEPARATOR."""
    generator = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 4, (300,), generator=generator).tolist()
    seq[40] = seq[170] = SEPARATOR
    whole, chunked = NgramIndex(max_matches=5), NgramIndex(max_matches=5)
    whole.extend(seq)
    cuts = [0, 1, 2, 39, 41, 100, 169, 171, 250, 300]
    for a, b in itertools.pairwise(cuts):
        chunked.extend(seq[a:b])
    for gram in {tuple(seq[i : i + n]) for n in range(1, 5) for i in range(len(seq) - n)}:
        if SEPARATOR in gram:
            assert whole._recent_ends(gram) == chunked._recent_ends(gram) == []
            continue
        ends = [i + len(gram) for i in range(len(seq) - len(gram)) if tuple(seq[i : i + len(gram)]) == gram]
        expected = [end for end in ends if seq[end] != SEPARATOR][-5:]
        assert whole._recent_ends(gram) == chunked._recent_ends(gram) == expected


def test_index_without_a_match_drafts_nothing_and_never_drafts_past_the_end():
    index = NgramIndex()
    index.extend([1, 2, 3])
    assert index.continuations([7], depth=4) == []
    assert index.continuations([1, 2, 3], depth=4) == []  # the only "2 3" is the end itself: no continuation


# ---------------------------------------------------------------------------------------------------------------------
# The output store


def test_store_insertion_lookup_and_documents_never_joined():
    store = OutputStore(max_tokens=100)
    store.add([5, 6, 7, 8])
    store.add([7, 8, 1])
    assert len(store) == 2 and store.num_tokens == 7
    paths = {c.path for c in store.candidates([3, 7], depth=3)}
    assert paths == {(8,), (8, 1)}  # no continuation runs from one answer into the next
    assert store.contains([5, 6, 7, 8]) and not store.contains([5, 6, 7])


def test_store_evicts_oldest_answers_at_its_bound():
    store = OutputStore(max_tokens=20)
    for start in range(0, 60, 6):
        store.add(list(range(start, start + 6)))
    assert store.num_tokens <= 20
    assert not store.contains(list(range(0, 6)))  # the oldest went first
    assert store.contains(list(range(54, 60)))  # the newest stays
    assert store.candidates([0, 1], depth=2) == []  # evicted answers are gone from the index too
    assert {c.path for c in store.candidates([55, 56], depth=2)} == {(57,), (57, 58)}


def test_store_save_load_round_trip_and_clear_errors(tmp_path):
    target = tiny_target("llama")
    store = OutputStore(max_tokens=50, fingerprint=weights_fingerprint(target))
    store.add([1, 2, 3, 4])
    store.add([3, 4, 9])
    path = store.save(tmp_path / "store.json")
    loaded = OutputStore.load(path, target)
    assert list(loaded.documents) == list(store.documents) and loaded.max_tokens == 50
    assert [c.path for c in loaded.candidates([3, 4], 1)] == [c.path for c in store.candidates([3, 4], 1)]

    cut = tmp_path / "cut.json"
    cut.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError, match="not JSON"):
        OutputStore.load(cut)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"paths": [[0]]}))
    with pytest.raises(ValueError, match="not an output store"):
        OutputStore.load(foreign)
    other = tiny_target("llama", seed=1)  # the same config, other weights: other answers
    with pytest.raises(
        DrafterMismatchError, match=f"fingerprint {weights_fingerprint(target)}.*{weights_fingerprint(other)}"
    ):
        OutputStore.load(path, other)
    with pytest.raises(FileNotFoundError):
        OutputStore.load(tmp_path / "nowhere.json")


def test_store_seeded_from_token_ids_and_texts(tmp_path):
    ids = tmp_path / "ids.jsonl"
    ids.write_text("[1, 2, 3]\n\n[4, 5]\n")
    assert list(OutputStore.seed(ids).documents) == [[1, 2, 3], [4, 5]]
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "ab"}\nplain line\n')

    class CharTokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    assert list(OutputStore.seed(texts, CharTokenizer()).documents) == [[97, 98], [ord(c) for c in "plain line"]]
    with pytest.raises(ValueError, match="tokenizer"):
        OutputStore.seed(texts)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, -2]\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        OutputStore.seed(bad)


def test_filling_a_store_stops_at_the_budget_and_evicts_nothing():
    store = OutputStore(max_tokens=10)
    store.add([1, 2, 3])
    documents = [[4, 5, 6], [], [7, 8], [9, 9, 9, 9], [1]]
    assert store.fill(iter(documents), num_tokens=9) == 2  # [4, 5, 6] and [7, 8]; [9, 9, 9, 9] would pass 9
    assert list(store.documents) == [[1, 2, 3], [4, 5, 6], [7, 8]] and store.num_tokens == 8
    assert {c.path for c in store.candidates([5], depth=2)} == {(6,)}  # filled answers are looked up
    assert store.fill([[9, 9, 9]], num_tokens=100) == 0  # never beyond max_tokens: 11 > 10 would evict [1, 2, 3]
    assert store.contains([1, 2, 3])


def test_an_answer_enters_the_store_only_after_its_generation():
    """While a prompt is generated its own answer is never in the store: nothing is added before the call returns,
    and `remember=False` (what an evaluation running several methods on one prompt uses) adds nothing at all."""
    target = tiny_target("llama")
    model = MedusaLikeModel(target, None, LookupDrafter(), backend="sdpa")
    store = model.drafter.store
    prompt = random_prompts(1, seed=3, min_len=8, max_len=8)[0]
    sizes = []
    out = model.generate(prompt, max_new_tokens=24, eos_token_id=[], streamer=lambda tokens: sizes.append(len(store)))
    assert sizes and set(sizes) == {0}  # at every step of the generation, the store was empty
    assert len(store) == 1 and store.contains(out.new_tokens.tolist())
    model.generate(prompt, max_new_tokens=24, eos_token_id=[], remember=False)
    assert len(store) == 1


# ---------------------------------------------------------------------------------------------------------------------
# Merging, scoring, the budget


class ScriptedSource:
    """A lookup source whose candidates are given: the inputs of the merge under test, not the merge itself."""

    def __init__(self, name: str, continuations: list[Continuation]):
        self.name, self.continuations = name, continuations

    def begin(self, history):
        pass

    def extend(self, tokens):
        pass

    def candidates(self, history, depth):
        return [c for c in self.continuations if len(c.path) <= depth]


def merged_tree(sources, num_nodes: int, per_node_ms: float = 0.0):
    target = tiny_target("llama")
    proposer = MergedTreeProposer(target, None, sources, SessionState(flat_cost(target, per_node_ms)))
    prompt = torch.tensor([1, 2, 3])
    proposer.begin(prompt, torch.zeros(3, 32), torch.tensor(4), capacity=64)
    return proposer, proposer.propose(BudgetedTreeSpec(None, num_nodes, lookup_depth=4))


def paths_of(tree) -> set[tuple[int, ...]]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (tokens[i],))
    return set(paths[1:])


def test_two_sources_proposing_the_same_prefix_give_one_path():
    a = ScriptedSource("a", [Continuation((7,), 1.0, 5), Continuation((7, 8), 1.0, 5)])
    b = ScriptedSource("b", [Continuation((7,), 1.0, 5), Continuation((7, 9), 1.0, 5)])
    _, tree = merged_tree([a, b], num_nodes=8)
    assert paths_of(tree) == {(7,), (7, 8), (7, 9)}
    assert tree.num_nodes == 4
    assert tree.source_names == ("a", "b")
    by_path = dict(zip([None, *sorted(paths_of(tree), key=len)], tree.sources.tolist(), strict=True))
    assert by_path[(7,)] == 0b11  # proposed by both


def test_scores_order_the_kept_nodes_and_the_budget_is_never_exceeded():
    likely = [Continuation((5,), 1.0, 8), Continuation((5, 6), 1.0, 8), Continuation((5, 6, 7), 1.0, 8)]
    unlikely = [Continuation((9,), 0.2, 1), Continuation((9, 3), 0.2, 1)]
    _, tree = merged_tree([ScriptedSource("s", likely + unlikely)], num_nodes=3)
    assert tree.num_nodes - 1 == 3
    assert paths_of(tree) == {(5,), (5, 6), (5, 6, 7)}  # the three likeliest, not the improbable branch
    for budget in (1, 2, 4):
        _, tree = merged_tree([ScriptedSource("s", likely + unlikely)], num_nodes=budget)
        assert tree.num_nodes - 1 <= budget


def test_costly_verification_cuts_unlikely_nodes():
    """With free verification every candidate is worth verifying; when each node costs as much as a whole forward,
    only nodes likely enough to pay for themselves are kept."""
    weak = [Continuation((9,), 0.3, 1), Continuation((9, 3), 0.3, 1), Continuation((4,), 0.3, 1)]
    _, free = merged_tree([ScriptedSource("s", weak)], num_nodes=8, per_node_ms=0.0)
    _, dear = merged_tree([ScriptedSource("s", weak)], num_nodes=8, per_node_ms=10.0)
    assert free.num_nodes == 4 and dear.num_nodes < free.num_nodes


def test_best_rate_maximises_expected_tokens_per_second():
    target = tiny_target("llama")
    cost = flat_cost(target, per_node_ms=1.0)  # verify(n) = 10 + n ms
    scores = {(1,): 0.9, (2,): 0.05}
    n, rate = best_rate(scores, cost, draft_ms=0.0)
    assert n == 1  # the 0.05 node adds 0.05 tokens for 1 ms: less than the 1.9 / 13 tokens per ms it dilutes
    assert rate == pytest.approx(1.9 / (cost.verify(2) + 1.0))


def test_the_learned_drafter_is_skipped_only_where_lookup_was_as_sure_when_steps_without_it_were_faster():
    """Its measured tokens per ms are kept per bucket of lookup's best score: slower where lookup is sure, it is not
    run there (outside probes) but still runs where lookup has nothing and it was faster."""
    target = tiny_target("llama")
    sure = ScriptedSource("context", [Continuation((7,), 1.0, 9)])
    nothing = ScriptedSource("context", [])
    assert lookup_certainty({(7,): 0.9}) == 3 and lookup_certainty({}) == 0
    slower, faster = [1.0, 30.0], [2.0, 30.0]  # [tokens, ms] per step
    state = SessionState(
        flat_cost(target), steps={(3, True): slower, (3, False): faster, (0, True): faster, (0, False): slower}
    )
    proposer = MergedTreeProposer(target, EAGLE3.fresh(target), [sure], state)
    width = len(proposer.feature_layers) * target.config.hidden_size
    proposer.begin(torch.tensor([1, 2, 3]), torch.zeros(3, width), torch.tensor(4), capacity=64)
    spec = BudgetedTreeSpec(DynamicTreeSpec(1, 2, 2), num_nodes=4, lookup_depth=4)
    proposer.step = 1  # not a probing step

    skipped = proposer.propose(spec)
    assert paths_of(skipped) == {(7,)} and state.learned_ms is None

    proposer.sources = [nothing]
    ran = proposer.propose(spec)
    learned_bit = 1 << ran.source_names.index("learned")
    assert state.learned_ms is not None
    assert len(paths_of(ran)) == 2 and all(bits & learned_bit for bits in ran.sources.tolist()[1:])


def test_the_learned_drafter_is_not_run_where_no_node_could_pay_for_its_place_in_a_batch():
    """In a batch whose forward a row's first extra node widens (`BatchShare`), priced where verifying twice the rows
    costs twice the time, not even a node sure to be accepted raises the batch's tokens per ms: the learned drafter is
    not run (nothing of it is measured). Alone, or where the wider forward costs little, it runs."""
    target = tiny_target("llama")
    nodes = (1, 2, 4, 8, 16, 32, 64)
    flat = flat_cost(target)
    steep = CostModel(  # ms linear in rows: a wider forward costs in proportion
        list(nodes), [10.0 * n for n in nodes], flat.target_fingerprint, flat.dtype, flat.device, flat.machine, "eager"
    )
    spec = BudgetedTreeSpec(DynamicTreeSpec(1, 2, 2), num_nodes=4, lookup_depth=4)
    runs = {}
    for name, cost, shared in [
        ("steep batch", steep, BatchShare(rows=7, widest=1, tokens=7.0)),
        ("alone", steep, None),
        ("flat batch", flat, BatchShare(rows=7, widest=1, tokens=7.0)),
    ]:
        state = SessionState(cost)
        proposer = MergedTreeProposer(target, EAGLE3.fresh(target), [ScriptedSource("context", [])], state)
        width = len(proposer.feature_layers) * target.config.hidden_size
        proposer.begin(torch.tensor([1, 2, 3]), torch.zeros(3, width), torch.tensor(4), capacity=64)
        proposer.propose(dataclasses.replace(spec, shared=shared))
        runs[name] = proposer.timed[1]
    assert runs == {"steep batch": False, "alone": True, "flat batch": True}


def test_the_learned_drafters_gate_measures_each_side_end_to_end_and_probes_the_slower_one():
    """A side never measured is tried first; each accepted step is recorded, with the tokens it gave, under its bucket
    and side; every PROBE_EVERY steps the side judged slower is taken, so a misjudgement can be undone."""
    target = tiny_target("llama")
    state = SessionState(flat_cost(target))
    proposer = MergedTreeProposer(target, EAGLE3.fresh(target), [ScriptedSource("context", [])], state)
    width = len(proposer.feature_layers) * target.config.hidden_size
    proposer.begin(torch.tensor([1, 2, 3]), torch.zeros(3, width), torch.tensor(4), capacity=256)
    spec = BudgetedTreeSpec(DynamicTreeSpec(1, 2, 2), num_nodes=4, lookup_depth=4)
    ran = []
    for _ in range(2 * PROBE_EVERY):
        tree = proposer.propose(spec)
        ran.append(proposer.timed[1])
        tokens = tree.tokens[:1]  # the root alone accepted: one token, the bonus
        proposer.accept(tokens, torch.zeros(1, width), torch.tensor(5))
    assert ran[:2] == [True, False]  # each side measured once before either is judged
    assert state.steps[0, True][0] == state.steps[0, False][0] == 1.0  # one token per step, on either side
    assert state.rate(0, True) < state.rate(0, False)  # drafting costs time and, all rejected, gives nothing
    assert ran[2:] == [i % PROBE_EVERY == 0 for i in range(2, 2 * PROBE_EVERY)]  # skipped but at step 8, a probe


def test_calibration_learns_from_outcomes():
    """A source whose candidates the target keeps rejecting gets a lower estimate after a few steps."""
    source = ScriptedSource("s", [Continuation((7,), 1.0, 5)])
    proposer, _ = merged_tree([source], num_nodes=4)
    before = next(iter(proposer.last.values())).q
    for _ in range(10):
        proposer.propose(BudgetedTreeSpec(None, 4, 4))
        proposer.accept(torch.tensor([4]), torch.zeros(1, 32), torch.tensor(8))  # the target said 8, not 7
    after = proposer.calibration.estimate(next(iter(proposer.last.values())).bucket, 1.0)
    assert after < before / 2


def test_agreement_of_two_sources_is_calibrated_apart_from_either_source_alone():
    """Where both sources propose a node the target accepts it, where one alone proposes one it rejects it: the agreed
    node's estimate rises, the lone ones' fall, and neither drags the other's along."""
    a = ScriptedSource("a", [Continuation((7,), 0.5, 3), Continuation((5,), 0.5, 3)])
    b = ScriptedSource("b", [Continuation((7,), 0.5, 3), Continuation((6,), 0.5, 3)])
    proposer, _ = merged_tree([a, b], num_nodes=4)
    first = {path: c.q for path, c in proposer.last.items()}
    for _ in range(20):
        proposer.propose(BudgetedTreeSpec(None, 4, 4))
        proposer.accept(torch.tensor([4, 7]), torch.zeros(2, 32), torch.tensor(8))  # the target said 7, then 8
    q = {path: c.q for path, c in proposer.last.items()}
    assert q[(7,)] > 0.8 > first[(7,)] and q[(5,)] < 0.2 < first[(5,)] and q[(6,)] < 0.2
    assert proposer.last[(7,)].bucket != proposer.last[(5,)].bucket


# ---------------------------------------------------------------------------------------------------------------------
# The cost model


def test_cost_model_is_saved_in_a_profile_and_refused_for_other_weights_or_dtype(tmp_path):
    """A machine profile's cost model holds for the weights it was measured on: another checkpoint of the same config
    (another seed) or the same weights in another dtype is refused, naming the fingerprints or dtypes."""
    target = tiny_target("llama")
    prepared = prepare_target(target, tuned_layers=False)
    cost = measure_cost_model(prepared, sizes=(4, 1, 8), prefix=8, repeats=1)
    assert cost.nodes == [1, 4, 8] and all(ms > 0 for ms in cost.verify_ms)
    assert cost.verify_ms == sorted(cost.verify_ms) and cost.verify_ms == non_decreasing_fit(cost.measured_ms)
    profile = write_profile(MachineProfile(False, prepared.identity(), cost), tmp_path / "profile.json")
    prepared.use_profile(profile)
    assert prepared.active.verify_ms == pytest.approx(cost.verify_ms, abs=1e-3) and prepared.profile is profile
    same_config = prepare_target(tiny_target("llama", seed=1), tuned_layers=False)
    with pytest.raises(ProfileMismatchError, match=f"target_fingerprint '{cost.target_fingerprint}'"):
        same_config.use_profile(profile)
    wider = prepare_target(tiny_target("llama").to(torch.float64), tuned_layers=False)
    with pytest.raises(ProfileMismatchError, match="dtype 'torch.float32' \\(here 'torch.float64'\\)"):
        wider.use_profile(profile)
    assert same_config.active is wider.active is None  # refused: nothing changed


def test_the_cost_fit_never_lets_more_nodes_cost_less_and_keeps_what_already_rises():
    assert non_decreasing_fit([3.0, 1.0, 2.0, 5.0, 4.0]) == pytest.approx([2.0, 2.0, 2.0, 4.5, 4.5])
    assert non_decreasing_fit([1.0, 2.0, 2.0, 7.0]) == [1.0, 2.0, 2.0, 7.0]
    # a file written before the fit (one slow spell at 5 nodes) is fitted on load
    target = tiny_target("llama")
    raw = flat_cost(target, nodes=(1, 4, 5, 6))
    raw.verify_ms = [70.0, 76.0, 108.0, 80.0]
    loaded = CostModel.from_json(raw.to_json())
    assert loaded.verify_ms == pytest.approx([70.0, 76.0, 94.0, 94.0])


def test_cost_model_interpolates_and_extrapolates():
    target = tiny_target("llama")
    cost = flat_cost(target, per_node_ms=2.0, nodes=(1, 4))  # 12 and 18 ms
    assert cost.verify(1) == 12.0 and cost.verify(2) == pytest.approx(14.0) and cost.verify(7) == pytest.approx(24.0)


# ---------------------------------------------------------------------------------------------------------------------
# Losslessness


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_source_and_their_combination_is_lossless(family, backend):
    """Each lookup source alone and both (budgeted trees), and both merged with random-weight EAGLE-3 and Medusa
    drafters on static, dynamic and budgeted trees: token for token the target's greedy output, drafts accepted."""
    target = tiny_target(family)
    prompts = random_prompts(2, seed=11, min_len=6, max_len=20)
    references = stock_greedy(untouched_target(family), prompts, 24)
    budgeted_tree = {"budgeted": {"num_nodes": 6, "lookup_depth": 6, "learned": None}}
    runs = [
        ("context", LookupDrafter(use=("context",)), budgeted_tree),
        ("store", LookupDrafter(use=("store",)), budgeted_tree),
        ("lookup", LookupDrafter(), "dynamic"),
    ]
    for learned_name, learned in (("eagle3", EAGLE3.fresh(target)), ("medusa", random_heads(num_heads=3))):
        combined = CombinedDrafter(learned, LookupDrafter())
        runs += [(f"{learned_name}+lookup", combined, tree) for tree in ("dynamic", [[0], [1], [0, 0]], budgeted_tree)]
    accepted = {}
    for name, drafter, tree in runs:
        model = MedusaLikeModel(target, None, drafter, backend=backend)
        drafter.state.cost_model = flat_cost(model.target, per_node_ms=0.5)
        repeats = 2 if name == "store" else 1  # the store drafts from earlier answers: ask again
        for prompt, reference in zip(prompts * repeats, references * repeats, strict=True):
            out = model.generate(prompt, max_new_tokens=24, tree=tree, eos_token_id=[])
            assert out.new_tokens.tolist() == reference, (name, tree)
            accepted[name] = accepted.get(name, 0) + sum(out.stats.accepted_draft)
    # tiny random targets repeat themselves: every source must have had drafts accepted, not only rejected
    assert all(count > 0 for count in accepted.values()), accepted


def test_plain_decoding_drafts_nothing_whatever_the_drafter(monkeypatch):
    """tree="none" is plain decoding for every drafter, lookup and combined too (they turn every other tree into a
    budgeted one): one node a step, no draft, tau exactly 1, greedy's tokens. The evaluation's reference (a) and its
    plain loop (c) decode `model.resolve_tree("none")`, which must be plain as well."""
    target = tiny_target("llama")
    prompt = random_prompts(1, seed=5, min_len=10, max_len=10)[0]
    reference = stock_greedy(untouched_target("llama"), [prompt], 40)[0]
    for drafter in (LookupDrafter(), CombinedDrafter(EAGLE3.fresh(target), LookupDrafter()), random_heads()):
        model = MedusaLikeModel(target, None, drafter, backend="sdpa")
        if sized_by_cost_model(drafter):
            drafter.state.cost_model = flat_cost(model.target)
        model.generate(prompt, max_new_tokens=40, eos_token_id=[])  # now in the store: lookup would draft it all
        step, nodes = model.forward.step, []
        forward = step.forward

        def counted(input_ids, *args, forward=forward, nodes=nodes, **kwargs):
            nodes.append(input_ids.shape[1])
            return forward(input_ids, *args, **kwargs)

        monkeypatch.setattr(step, "forward", counted)
        for tree in ("none", model.resolve_tree("none")):
            nodes.clear()
            out = model.generate(prompt, max_new_tokens=40, tree=tree, eos_token_id=[])
            assert out.new_tokens.tolist() == reference, (drafter.kind, tree)
            assert out.stats.tau == 1.0 and not any(out.stats.accepted_draft), (drafter.kind, tree)
            assert nodes == [prompt.numel()] + [1] * 39, (drafter.kind, tree)
        monkeypatch.undo()


def test_combined_tree_counts_each_sources_accepted_tokens():
    target = tiny_target("llama")
    drafter = CombinedDrafter(EAGLE3.fresh(target), LookupDrafter())
    model = MedusaLikeModel(target, None, drafter, backend="sdpa")
    drafter.state.cost_model = flat_cost(model.target)
    prompt = random_prompts(1, seed=5, min_len=10, max_len=10)[0]
    model.generate(prompt, max_new_tokens=40, eos_token_id=[])
    out = model.generate(prompt, max_new_tokens=40, eos_token_id=[])  # the store now holds the first answer
    assert out.stats.accepted_by_source.get("store", 0) > 0
    assert sum(out.stats.accepted_by_source.values()) >= sum(out.stats.accepted_draft)


def test_budgeted_tree_json_round_trip_and_static_learned_part():
    spec = BudgetedTreeSpec(TokenTree.from_paths([[0], [1], [0, 0]]), num_nodes=5, lookup_depth=3)
    again = spec_from_json(spec.to_json())
    assert again.learned.paths == spec.learned.paths and again.num_nodes == 5 and again.lookup_depth == 3
    assert spec.max_depth == 3 and spec.max_nodes == 6 and spec.top_k == 2
