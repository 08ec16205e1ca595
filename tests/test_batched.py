"""Batched decoding (decoding/batch.py) on tiny random targets: each row of a batch gets the tokens its prompt gets
alone. Greedy rows equal transformers' own greedy on an untouched copy, and seeded sampled rows equal the prompt's own
seeded batch-1 run, on every family and attention backend, with ragged prompts read in several prefill chunks and
rows that stop early (EOS, a stop string, max_new_tokens) while the others go on; speculative batches equal greedy for
every drafter kind and tree kind; every node of every row sees exactly its own path, whether the forward pads the
rows' trees or packs their real nodes; the budget of a row that sizes its tree by a cost model counts the batch's
nodes, as the step computes them; at most `batch_size` rows decode at once, waiting prompts taking finished rows'
places with the same tokens; the compiled step's buckets give each row its tokens; a batch that does not fit is
refused before any work."""

from functools import cache

import pytest
import torch

from medusa_like.decoding.batch import prefill
from medusa_like.decoding.batch_inputs import tree_inputs
from medusa_like.decoding.cost_model import BatchShare
from medusa_like.decoding.draft_tree import DraftTree
from medusa_like.decoding.kv_cache import CacheOverflowError
from medusa_like.decoding.step import EagerStep
from medusa_like.decoding.tree import budgeted, in_batch
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.budget import best_rate
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.drafters.protocol import sized_by_cost_model
from medusa_like.drafters.registry import all_kinds
from medusa_like.model import MedusaLikeModel

from .conftest import VOCAB, flat_cost, random_heads, random_prompts, stock_greedy, tiny_target, untouched_target
from .test_api_contract import LetterTokenizer
from .test_sampling_power import fresh_drafter

BACKENDS = ["eager", "sdpa", "flash"]  # flash: its pure-torch reference off CUDA
NEW_TOKENS = 12
CHUNK = 16  # prefill tokens per forward: the ragged prompts below take several chunks, rows leaving as they end
WARP = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}


@cache
def references(family: str) -> tuple:
    """Five ragged prompts (8 to 27 tokens: a batch between the compiled step's buckets, longer than the sliding
    window) and transformers' greedy continuations of an untouched copy of the `family` target."""
    prompts = random_prompts(5, seed=5, min_len=1, max_len=30)
    return prompts, stock_greedy(untouched_target(family), prompts, NEW_TOKENS)


def new_tokens(outs) -> list[list[int]]:
    return [out.new_tokens.tolist() for out in outs]


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_greedy_and_sampling_give_each_row_its_prompts_own_tokens(family, backend):
    """Greedy: each row is transformers' greedy of its prompt, its output and stats its own. Sampled, each row with
    its own seed: each row is its prompt's batch-1 draw with that seed (and not the greedy tokens)."""
    prompts, expected = references(family)
    model = MedusaLikeModel(tiny_target(family), None, random_heads(), backend=backend)
    outs = model.generate(prompts, NEW_TOKENS, tree="none", eos_token_id=[], prefill_chunk_size=CHUNK)
    assert new_tokens(outs) == expected
    for out, prompt in zip(outs, prompts, strict=True):
        assert out.finish_reason == "length" and out.stats.new_tokens == NEW_TOKENS == out.stats.target_forwards
        assert torch.equal(out.sequences[0, : prompt.shape[1]], prompt[0])
    seeds = [11, 12, 13, 14, 15]
    alone = [
        model.generate(p, NEW_TOKENS, tree="none", eos_token_id=[], seed=seed, **WARP).new_tokens.tolist()
        for p, seed in zip(prompts, seeds, strict=True)
    ]
    sampled = model.generate(
        prompts, NEW_TOKENS, tree="none", eos_token_id=[], seed=seeds, prefill_chunk_size=CHUNK, **WARP
    )
    assert new_tokens(sampled) == alone and alone != expected


@pytest.mark.parametrize("tree", ["none", "small"])
def test_rows_stop_on_their_own_and_the_others_go_on(family, tree):
    """An EOS id that some rows' greedy output holds stops those rows there (finish "eos") and the others run to
    max_new_tokens ("length"); a stop string does the same ("stop_string"); a batch of three (between buckets) and
    of five alike."""
    prompts, expected = references(family)
    model = MedusaLikeModel(tiny_target(family), LetterTokenizer(), random_heads(), backend="sdpa")
    # an EOS id in the first row's output, past its first tokens, that some other row never produces
    eos = next(t for t in expected[0][3:] if any(t not in row for row in expected[1:3]))
    for rows in (prompts, prompts[:3]):
        outs = model.generate(rows, NEW_TOKENS, tree=tree, eos_token_id=eos, prefill_chunk_size=CHUNK)
        for out, reference in zip(outs, expected, strict=False):
            stops = eos in reference
            assert out.new_tokens.tolist() == (reference[: reference.index(eos) + 1] if stops else reference)
            assert out.finish_reason == ("eos" if stops else "length")
        assert {out.finish_reason for out in outs} == {"eos", "length"}
    letters = LetterTokenizer()
    stop = letters.decode(expected[1][4:6])  # one letter per token: the text's index is the token's
    outs = model.generate(prompts, NEW_TOKENS, tree=tree, eos_token_id=[], stop_strings=stop, prefill_chunk_size=CHUNK)
    for out, reference in zip(outs, expected, strict=True):
        at = letters.decode(reference).find(stop)
        assert out.new_tokens.tolist() == (reference if at < 0 else reference[: at + len(stop)])
        assert out.finish_reason == ("length" if at < 0 else "stop_string")
    assert outs[1].finish_reason == "stop_string"


def rows_per_forward(model) -> list[int]:
    """The rows of every batched target forward `model` runs from now on (its step's `forward_batch`, observed)."""
    step, seen = model.forward.step, []
    run = step.forward_batch

    def counted(input_ids, *args, **kwargs):
        seen.append(input_ids.shape[0])
        return run(input_ids, *args, **kwargs)

    step.forward_batch = counted
    return seen


@pytest.mark.parametrize("tree", ["none", "small"])
def test_a_finished_rows_place_goes_to_the_next_waiting_prompt(family, tree, monkeypatch):
    """batch_size=2 over five prompts: never more than two rows in a forward; as rows stop (an EOS some rows' outputs
    hold) the waiting prompts join in order, and every row, joined late or not, is transformers' greedy of its prompt
    cut at its EOS; seeded sampled rows are their prompts' batch-1 draws."""
    from medusa_like.decoding import batch as batch_loop

    prompts, expected = references(family)
    model = MedusaLikeModel(tiny_target(family), None, random_heads(), backend="sdpa")
    eos = next(t for t in expected[0][3:] if any(t not in row for row in expected[1:]))
    seen, joined, admit = rows_per_forward(model), [], batch_loop.admit
    monkeypatch.setattr(batch_loop, "admit", lambda *args: joined.append(list(args[4])) or admit(*args))
    outs = model.generate(prompts, NEW_TOKENS, tree=tree, eos_token_id=eos, prefill_chunk_size=CHUNK, batch_size=2)
    assert new_tokens(outs) == [r[: r.index(eos) + 1] if eos in r else r for r in expected]
    assert max(seen) == 2 and seen.count(2) > len(seen) // 2  # the batch stayed full while prompts waited
    assert joined[0] == [0, 1] and sum(joined, []) == [0, 1, 2, 3, 4]  # first come, first served
    seeds = [11, 12, 13, 14, 15]
    alone = [
        model.generate(p, NEW_TOKENS, tree=tree, eos_token_id=[], seed=seed, **WARP).new_tokens.tolist()
        for p, seed in zip(prompts, seeds, strict=True)
    ]
    sampled = model.generate(prompts, NEW_TOKENS, tree=tree, eos_token_id=[], seed=seeds, batch_size=3, **WARP)
    assert new_tokens(sampled) == alone


def test_a_joining_rows_cache_is_appended_with_its_own_lengths():
    """`extend` puts the joining cache's rows after the batch's, each with its entries and committed length, and
    refuses a cache of another capacity."""
    from medusa_like.decoding.kv_cache import BatchTreeKVCache

    target = tiny_target("llama")
    step, prompts = EagerStep(target, "sdpa"), random_prompts(3, seed=2, min_len=3, max_len=9)
    caches = [step.new_batch_cache(1, 32) for _ in prompts]
    for part, prompt in zip(caches, prompts, strict=True):
        prefill(step, part, [prompt[0]], None, CHUNK)
    joined = caches[0].extend(caches[1]).extend(caches[2])
    assert joined.rows == 3 and joined.lengths == [p.shape[1] for p in prompts]
    for row, (part, prompt) in enumerate(zip(caches[1:], prompts[1:], strict=True), start=1):
        length = prompt.shape[1]
        assert torch.equal(joined.layers[0].keys[row, :, :length], part.layers[0].keys[0, :, :length])
    with pytest.raises(ValueError, match="capacity 16 to one of 32"):
        joined.extend(BatchTreeKVCache.for_model(target, 1, 16))


@pytest.mark.parametrize("tree", ["small", "dynamic"])  # static rank paths, EAGLE-2's dynamic; budgeted for lookup
@pytest.mark.parametrize("kind", sorted(all_kinds()))
def test_batched_speculative_decoding_equals_greedy_for_every_drafter_kind(kind, tree):
    """Every registered kind's new drafter, each row proposing its own tree through its own proposer and one forward
    verifying them all: each row is transformers' greedy; drafts were accepted (lookup and combined adapt the tree to
    a budgeted one, priced by the batch's nodes). So it is with two rows at a time, the others joining as rows end."""
    prompts, expected = references("llama")
    target = tiny_target("llama")
    torch.manual_seed(0)  # a new drafter's random weights: the same whatever ran before
    model = MedusaLikeModel(target, None, fresh_drafter(kind, target))
    if sized_by_cost_model(model.drafter):
        model.drafter.use_cost_model(flat_cost(model.target, per_node_ms=0.2))
    for batch_size in (None, 2):
        outs = model.generate(
            prompts, NEW_TOKENS, tree=tree, eos_token_id=[], remember=False, prefill_chunk_size=CHUNK,
            batch_size=batch_size,
        )  # fmt: skip
        assert new_tokens(outs) == expected, batch_size
        assert sum(sum(out.stats.accepted_draft) for out in outs) > 0, "only the all-rejected path was tested"


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_node_of_every_row_sees_exactly_its_path(family, backend, packed):
    """Three rows of other committed lengths (one longer than the window), each its own tree (a chain, a branching
    tree, the root alone), verified in one forward, then the accepted paths committed at each row's offset and
    a second step verified: every node's logits are those of its prompt, its row's committed path and its own path
    through an untouched copy of the target. Padded, the forward computes 3 x 6 nodes; packed (told each row's node
    count), the 11 real ones alone."""
    target, untouched = tiny_target(family), untouched_target(family)
    step = EagerStep(target, backend)
    computed = []
    target.get_input_embeddings().register_forward_hook(lambda _, args, out: computed.append(args[0].shape))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (14, 9, 3)]  # longest first: the cache's order
    trees = [[-1, 0, 1, 2], [-1, 0, 0, 1, 3, 2], [-1]]
    accepted = [[0, 1, 2], [0, 2], [0]]  # a path of each tree, root first
    cache = step.new_batch_cache(3, 40)
    committed = [p.tolist() for p in prompts]
    with torch.inference_mode():
        last, _ = prefill(step, cache, prompts, None, chunk_size=12)  # [3, V]: chunks of 4 tokens a row
        for row, prompt in enumerate(prompts):
            torch.testing.assert_close(last[row], untouched(prompt[None]).logits[0, -1], atol=1e-4, rtol=1e-4)
        for _ in range(2):
            drafts = [
                DraftTree.from_parents(torch.randint(0, VOCAB, (len(p),), generator=g), torch.tensor(p)) for p in trees
            ]
            nodes = [d.num_nodes for d in drafts] if packed else None
            computed.clear()
            logits, _ = step.forward_batch(*tree_inputs(cache.lengths, drafts), cache, nodes=nodes)  # [3, T, V]
            assert computed == [torch.Size([1, 11]) if packed else torch.Size([3, 6])]
            for row, draft in enumerate(drafts):
                for node in range(draft.num_nodes):
                    path = draft.tokens[draft.attention_mask[node]].tolist()  # root to node
                    expected = untouched(torch.tensor([committed[row] + path])).logits[0, -1]
                    torch.testing.assert_close(logits[row, node], expected, atol=1e-4, rtol=1e-4)
            cache.commit([torch.tensor(nodes) for nodes in accepted])
            for row, draft in enumerate(drafts):
                committed[row] += draft.tokens[accepted[row]].tolist()
    assert cache.lengths == [len(c) for c in committed]


def test_a_rows_budget_counts_the_batchs_nodes():
    """Where a node costs 0.1 ms over 10, a row alone keeps all 12 candidates; in a batch of 8 whose other rows verify
    one node each, its nodes widen the whole batch's forward (8 rows each), so it keeps fewer. Where a node costs 1 ms,
    a row alone drops its least likely candidate; beside a row 13 nodes wide, nodes up to that width cost nothing
    more, so it keeps them all. On a step that packs, a node costs one node of the batch's forward."""
    target = tiny_target("llama")
    scores = {(i,): 0.9**i for i in range(1, 13)}  # 12 candidates, each likelier than the next
    cheap, dear = flat_cost(target, per_node_ms=0.1), flat_cost(target, per_node_ms=1.0)
    narrow_batch, wide_batch = BatchShare(rows=7, widest=1, tokens=7.0), BatchShare(rows=7, widest=13, tokens=7.0)
    assert 0 < best_rate(scores, cheap, 0.0, shared=narrow_batch)[0] < best_rate(scores, cheap, 0.0)[0] == 12
    assert best_rate(scores, dear, 0.0)[0] == 11 < best_rate(scores, dear, 0.0, shared=wide_batch)[0] == 12
    # a step that packs computes the real nodes alone: a row's node costs one node of the batch's forward, so where
    # a node is cheap the row keeps all its candidates, as alone; where it is dear, each must pay at the batch's
    # rate (8 rows' tokens per ms), higher than the row's alone
    packed = BatchShare(rows=7, widest=1, tokens=7.0, nodes=7, packed=True)
    assert best_rate(scores, cheap, 0.0, shared=packed)[0] == 12
    assert 0 < best_rate(scores, dear, 0.0, shared=packed)[0] < 11


def test_a_rows_learned_drafter_runs_in_a_batch_only_where_its_time_pays():
    """In a batch of 8 on a packed step (verifying a node costs 0.2 ms over 10), a combined row runs its learned
    drafter where that drafter's time would be paid back by one sure node at the batch's rate: a drafter of 0.5 ms
    is run, one of 5 ms (half a step, while every row waits) is not, though a sure node alone would raise the
    batch's tokens."""
    target = tiny_target("llama")
    drafter = fresh_drafter("combined", target)
    proposer = drafter.proposer(target)
    proposer.cost = flat_cost(target, per_node_ms=0.2)
    spec = in_batch(budgeted(resolve_tree("dynamic")), BatchShare(rows=7, widest=1, tokens=7.0, nodes=7, packed=True))
    proposer.state.learned_ms = 0.5
    assert proposer._a_node_can_pay(spec, lookup_ms=0.1)
    proposer.state.learned_ms = 5.0
    assert not proposer._a_node_can_pay(spec, lookup_ms=0.1)
    assert best_rate({(0,): 1.0}, proposer.cost, 0.1, shared=spec.shared)[0] == 1


def test_each_finished_row_is_remembered_once():
    """A lookup drafter's output store holds each row's answer once after a batch."""
    prompts, expected = references("llama")
    model = MedusaLikeModel(tiny_target("llama"), None, LookupDrafter())
    model.drafter.use_cost_model(flat_cost(model.target))
    outs = model.generate(prompts[:3], NEW_TOKENS, tree="dynamic", eos_token_id=[])
    assert new_tokens(outs) == expected[:3]
    store = model.drafter.store
    assert len(store) == 3 and all(store.contains(tokens) for tokens in expected[:3])


def test_a_batch_that_does_not_fit_is_refused_before_any_work():
    """A batch whose longest prompt, new tokens and tree overflow max_cache_len, or the target's positions, is refused
    with one line naming the prompt and what fits, before the target computes anything; so are a streamer with a
    batch and a list of seeds of the wrong length."""
    prompts, _ = references("llama")
    target = tiny_target("llama", max_position_embeddings=40)
    model = MedusaLikeModel(target, None, random_heads())
    forwards = []
    target.base_model.register_forward_pre_hook(lambda *_: forwards.append(1))
    longest = max(p.shape[1] for p in prompts)  # prompt 4, 27 tokens
    with pytest.raises(
        CacheOverflowError,
        match=rf"prompt 4 of the batch \({longest} tokens\).*prompts of up to 18 "
        rf"tokens fit, or max_cache_len={longest + 12} fits",
    ):
        model.generate(prompts, 11, tree="none", max_cache_len=30)
    with pytest.raises(ValueError, match="prompt 4 of the batch.*max_position_embeddings \\(40\\)"):
        model.generate(prompts, 20, tree="none")
    with pytest.raises(ValueError, match="a streamer follows one sequence"):
        model.generate(prompts, 4, tree="none", streamer=lambda tokens: None)
    with pytest.raises(ValueError, match="a list of 2 seeds for a batch of 5 prompts"):
        model.generate(prompts, 4, tree="none", seed=[1, 2], temperature=1.0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        model.generate(prompts, 4, tree="none", batch_size=0)
    with pytest.raises(TypeError, match="prompt 1 of the batch"):
        model.generate([prompts[0], "not ids"], 4, tree="none")
    assert forwards == []


@pytest.mark.slow
def test_the_compiled_batched_step_gives_each_row_its_tokens():
    """On the compiled step, a batch of three runs in the bucket of four (a padding row), greedy with one node a row
    and speculative trees; a row that stops early moves the rest into the bucket of two: every row is transformers'
    greedy, and every step ran compiled."""
    from medusa_like.forward import prepare_target
    from medusa_like.forward.compiled import CompiledStep
    from medusa_like.forward.platform import CompileUnsupported, compile_settings

    target = tiny_target("llama")
    try:
        compile_settings(target)
    except CompileUnsupported as why:
        pytest.skip(f"no compiled step here: {why}")
    prepared = prepare_target(target, tuned_layers=False, compile=True)
    assert isinstance(prepared.step, CompiledStep)
    prepared.step.options = {**prepared.step.options, "max_autotune": False}  # as tests/test_compiled.py compiles
    prompts, expected = references("llama")
    rows, expected = prompts[:3], expected[:3]
    model = MedusaLikeModel(prepared, None, random_heads())
    eos = next(t for t in expected[0][3:] if all(t not in row for row in expected[1:]))
    outs = model.generate(rows, NEW_TOKENS, tree="none", eos_token_id=eos)
    assert new_tokens(outs) == [expected[0][: expected[0].index(eos) + 1], *expected[1:]]
    outs = model.generate(rows, NEW_TOKENS, tree="small", eos_token_id=[])
    assert new_tokens(outs) == expected and sum(sum(out.stats.accepted_draft) for out in outs) > 0
    # two rows at a time: the first row's EOS frees its place (bucket 2 -> 1), the next prompt joins (1 -> 2)
    outs = model.generate(prompts, NEW_TOKENS, tree="none", eos_token_id=eos, batch_size=2)
    cut = references("llama")[1]
    assert new_tokens(outs) == [r[: r.index(eos) + 1] if eos in r else r for r in cut]
    assert prepared.step.failed is None and {(4, True), (2, True), (4, False)} <= set(prepared.step.graphs)


@pytest.mark.slow
def test_an_evaluation_at_batch_size_two_decodes_each_turn_as_one_batch(tmp_path, eval_cfg):
    """eval.batch_size=2: the two questions' first turns are one batch, the second question's second turn a batch of
    one; the run stays lossless, each prompt's record carries its batch, and the report gives tokens/s per prompt and
    in total, the latter against our loop's batched greedy decoding (c)."""
    from eval.evaluate import evaluate
    from medusa_like.evaluation.prompt_loop import load_records

    from .test_eval import QUESTIONS, write_jsonl

    questions = write_jsonl(tmp_path / "questions.jsonl", QUESTIONS)  # two turns, then one
    run = tmp_path / "run"
    settings = ("eval.max_new_tokens=8", "eval.batch_size=2", "drafter.mode=learned", "tree=small")
    cfg = eval_cfg(
        f"data.path={questions}", *settings, "eval.sweep.prompts=0", "eval.head_accuracy=false", f"out_dir={run}"
    )
    report = evaluate(cfg)
    assert report["summary"]["lossless"]
    sizes = {
        (int(r["question_id"]), r["turn"]): r["speculative"]["batch"]["size"]
        for r in load_records(run / "prompts.jsonl")
    }
    assert sizes == {(1, 1): 2, (2, 1): 2, (1, 2): 1}
    in_total = report["speed"]["in_total"]
    assert in_total["batch_size"] == 2 and all(tps > 0 for tps in in_total["tokens_per_second"].values())
    text = (run / "report.md").read_text()
    assert "Speed at batch size 2" in text and "in total vs (c)" in text  # against greedy batched as ours are
    assert "| (c) our loop, no drafter |" in text and "| 1.00x |" in text


def test_the_batch_benchmark_times_each_method_at_each_size_and_checks_every_row():
    """benchmarks/batch.py on a tiny chat target: greedy and lookup at batch 1 and 3, every row equal to its batch-1
    greedy output, speeds relative to greedy at the same size and at batch 1; five prompts at each size, as many rows
    at a time as the size, every row checked too."""
    from benchmarks import batch
    from medusa_like.tiny import tiny_chat_target

    target, tokenizer = tiny_chat_target("llama", hidden_size=64, num_layers=2)
    model = MedusaLikeModel(target, tokenizer, LookupDrafter())
    model.drafter.use_cost_model(flat_cost(model.target))
    rows, notes = batch.batch_speed({"greedy": (model, "none"), "lookup": (model, "dynamic")}, [1, 3], 6)
    assert [(r["method"], r["batch_size"]) for r in rows] == [(m, b) for b in (1, 3) for m in ("greedy", "lookup")]
    assert notes == [] and [r["equal_rows"] for r in rows] == [1, 1, 3, 3]
    assert all(r["tokens_per_second"] > 0 and r["tokens_per_second_per_row"] > 0 for r in rows)
    assert [r["vs_greedy_same_batch"] for r in rows if r["method"] == "greedy"] == [1.0, 1.0]
    assert rows[0]["vs_greedy_batch_1"] == 1.0
    rows, notes = batch.batch_speed({"greedy": (model, "none"), "lookup": (model, "dynamic")}, [1, 3], 6, count=5)
    assert notes == [] and [(r["prompts"], r["equal_rows"]) for r in rows] == [(5, 5)] * 4  # 3 rows at a time
