"""Choosing a tree for a drafter on this machine.

Medusa heads (static trees): calibrate the top-k accuracy at each depth, build the best tree of each node budget, time
them.

    topk = depth_topk_accuracy(model, sequences)          # teacher-forced over the target's own greedy answers
    trees = trees_for_budgets(topk, [4, 8, 16, 32])        # greedy best-first trees (`tree_presets.greedy_tree`)

EAGLE-3 (dynamic trees): the candidates are (depth, top_k, num_nodes) settings of EAGLE-2's tree.

Both are then timed the same way, and the fastest is kept (`tree=auto`):

    rows = time_trees(model, prompts, trees, 128)          # tau and tokens/s per tree, interleaved per prompt
    best = fastest(rows)

A tree's speed here is the geometric mean of its per-prompt tokens/s (`timing.geometric_mean_tps`): every tree runs the
same few prompts, and a median of three is one prompt's figure, where trees a few percent apart swap places by chance.

A budget counts candidate nodes, the root (the target's own next token) excluded: budget 0 is plain decoding.
"""

from collections.abc import Callable, Sequence

import torch

from medusa_like.decoding.tree import BudgetedTreeSpec, DynamicTreeSpec
from medusa_like.decoding.tree_presets import expected_acceptance, greedy_tree
from medusa_like.drafters.protocol import sized_by_cost_model
from medusa_like.drafters.registry import kind_of
from medusa_like.evaluation.methods import hf_runner, loop_runner
from medusa_like.evaluation.metrics import (
    TOPK_MAX,
    rank_accuracy,
    rank_counts,
    summarize_decode,
    topk_from_counts,
)
from medusa_like.evaluation.timing import geometric_mean_tps, time_methods

Path_ = tuple[int, ...]


# ---------------------------------------------------------------------------------------------------------------------
# Rank accuracy by depth (drafters whose depth-d candidates do not depend on the path: Medusa heads)


def depth_rank_counts(model, sequence: torch.Tensor, prompt_len: int, k_max: int = TOPK_MAX) -> list[list[int]]:
    """Per depth, `metrics.rank_counts` of the right token over the answer part of one sequence [1, L], teacher-forced
    (the drafter's kind measures the ranks: `DrafterKind.depth_ranks`)."""
    ranks = kind_of(model.drafter).depth_ranks(model.drafter, model.target, sequence, prompt_len)
    if ranks is None:
        raise ValueError(f"a {model.drafter_kind} drafter's trees are not built from rank accuracies")
    return [rank_counts(r, k_max) for r in ranks]


def depth_topk_accuracy(
    model, sequences: Sequence[tuple[torch.Tensor, int]], k_max: int = TOPK_MAX
) -> list[list[float]]:
    """(sequence [1, L], prompt length) pairs -> topk[d][j] = top-(j+1) accuracy at depth d+1, pooled over positions."""
    pooled = None
    for sequence, prompt_len in sequences:
        counts = depth_rank_counts(model, sequence, prompt_len, k_max)
        pooled = (
            counts
            if pooled is None
            else [[a + b for a, b in zip(p, c, strict=True)] for p, c in zip(pooled, counts, strict=True)]
        )
    if pooled is None or pooled[0][-1] == 0:
        raise ValueError("rank accuracy needs at least one answer longer than the drafter's depth")
    return [topk_from_counts(c) if c[-1] else [0.0] * k_max for c in pooled]


# ---------------------------------------------------------------------------------------------------------------------
# Trees


def trees_for_budgets(topk: Sequence[Sequence[float]], budgets: Sequence[int]) -> dict[int, list[Path_]]:
    """The greedy best tree of each node budget from per-head top-k accuracies."""
    ranks = [rank_accuracy(t) for t in topk]
    for b in budgets:
        if not isinstance(b, int) or b < 0:
            raise ValueError(f"tree budgets are numbers of candidate nodes >= 0, got {b!r}")
    return {b: greedy_tree(ranks, b) for b in budgets}


def predicted_tau(paths, topk: Sequence[Sequence[float]]) -> float:
    """1 + expected accepted draft tokens per step, under independent heads (ignores the prefill forward)."""
    return 1.0 + expected_acceptance(paths, [rank_accuracy(t) for t in topk])


# ---------------------------------------------------------------------------------------------------------------------
# Timing


def own_session(model, runner):
    """`runner`, its calls made with a drafter that learns in a session of its own (calibration, the learned drafter's
    gate), started from a copy of the model's drafter's (`Drafter.fork`). A combined or lookup drafter learns across
    generations: candidates timed on the same model would otherwise learn from each other's steps, and a tree's speed
    would depend on the trees timed beside it. The model's own drafter is left as it was."""
    if not sized_by_cost_model(model.drafter):  # it learns nothing across generations
        return runner
    own = model.drafter.fork()

    def run(ids: torch.Tensor, max_new_tokens: int):
        saved, model.drafter = model.drafter, own
        try:
            return runner(ids, max_new_tokens)
        finally:
            model.drafter = saved

    return run


def time_trees(
    model,
    prompts: Sequence[torch.Tensor],
    trees: dict,
    max_new_tokens: int,
    eos_token_id=None,
    progress: Callable[[], None] | None = None,
) -> list[dict]:
    """Run every tree on every prompt with the timing harness (`timing.time_methods`: interleaved per prompt in
    rotated order, after a short warm-up on the first prompt).

    `trees` maps a key (a node budget, or a label) to anything `model.resolve_tree` takes: rank paths or a
    `DynamicTreeSpec`. Each tree learns across the prompts in a session state of its own (`own_session`). Returns one
    row per tree: key, nodes, depth, measured tau, mean accepted draft tokens, tokens/s (the geometric mean of the
    prompts') and the milliseconds per step spent drafting and verifying.
    """
    if not prompts:
        raise ValueError("timing trees needs at least one prompt")
    compiled = {b: model.resolve_tree(spec) for b, spec in trees.items()}
    runners = {b: own_session(model, loop_runner(model, tree, eos_token_id)) for b, tree in compiled.items()}
    results = time_methods(runners, prompts, max_new_tokens, progress=progress)
    rows = []
    for b, tree in compiled.items():
        summary = summarize_decode([r["stats"] for r in results[b]])
        rows.append(
            {
                "budget": b,
                "nodes": tree.max_nodes,
                "depth": tree.max_depth,
                "tau": summary["tau"],
                "mean_accepted_draft": summary["mean_accepted_draft"],
                "tokens_per_second": geometric_mean_tps(results[b]),
                "tokens_per_second_per_prompt": [r["tps"] for r in results[b]],
                "draft_ms_per_step": summary["draft_ms_per_step"],
                "verify_ms_per_step": summary["verify_ms_per_step"],
            }
        )
    return rows


def fastest(rows: Sequence[dict]) -> dict:
    """The row with the highest tokens/s (ties: the smaller budget)."""
    if not rows:
        raise ValueError("no timed budgets to choose from")
    return max(rows, key=lambda r: (r["tokens_per_second"], -r["nodes"]))


# ---------------------------------------------------------------------------------------------------------------------
# The search


def parse_budget(budget) -> int | str:
    if budget == "auto":
        return "auto"
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
        return budget
    raise ValueError(f"tree_search.budget must be 'auto' or a number of nodes >= 0, got {budget!r}")


def dynamic_candidates(grid) -> dict[str, DynamicTreeSpec]:
    """`[[depth, top_k, num_nodes], ...]` -> labelled dynamic tree specs."""
    specs = [DynamicTreeSpec(*map(int, row)) for row in grid]
    if not specs:
        raise ValueError("tree_search.dynamic needs at least one [depth, top_k, num_nodes] row")
    return {s.label: s for s in specs}


def budgeted_candidates(learned_grid, num_nodes, lookup_depth: int, with_learned: bool) -> dict[str, BudgetedTreeSpec]:
    """Budgeted trees: each learned dynamic setting of `learned_grid` (none for lookup alone) x each node budget."""
    learned = [DynamicTreeSpec(*map(int, row)) for row in learned_grid] if with_learned else [None]
    specs = [BudgetedTreeSpec(spec, int(n), int(lookup_depth)) for spec in learned for n in num_nodes]
    if not specs:
        raise ValueError("tree_search.budgeted needs at least one node budget (and one learned row for a drafter)")
    return {s.label: s for s in specs}


def fastest_prompt_lookup(model, prompts, max_new_tokens: int, candidates) -> tuple[int, list[dict]]:
    """transformers' prompt lookup at each `prompt_lookup_num_tokens` of `candidates`, timed with the harness: the
    fastest value on this machine and the rows (value, tokens/s: the geometric mean over prompts)."""
    eos = model.eos_token_ids()
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    runners = {int(n): hf_runner(model.target, eos, pad, int(n)) for n in candidates}
    results = time_methods(runners, prompts, max_new_tokens)
    rows = [{"prompt_lookup_num_tokens": n, "tokens_per_second": geometric_mean_tps(results[n])} for n in runners]
    return max(rows, key=lambda r: r["tokens_per_second"])["prompt_lookup_num_tokens"], rows


def greedy_sequences(model, prompts, max_new_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """(prompt + the target's greedy answer [1, L], prompt length) for each prompt."""
    out = []
    for ids in prompts:
        result = model.generate(ids, max_new_tokens=max_new_tokens, tree="none")
        out.append((result.sequences, ids.shape[1]))
    return out


def search(
    model,
    prompts,
    timing_prompts: int,
    max_new_tokens: int,
    budget,
    budgets,
    dynamic_grid,
    k_max=TOPK_MAX,
    budgeted=None,
):
    """The fastest tree for `model`'s drafter on `prompts` (dict: kind, tree spec, timings, calibration).

    Drafters sized by a cost model (lookup, combined): budgeted trees, `budgeted.learned` settings x
    `budgeted.num_nodes`, all timed. Kinds whose trees are static (Medusa heads): trees built from the measured rank
    accuracy at each depth, one per budget (`budget` fixes one). Others (EAGLE-3): the dynamic settings of
    `dynamic_grid`, all timed.
    """
    timing = prompts[: max(timing_prompts, 1)]
    if budgeted is not None and sized_by_cost_model(model.drafter):  # lookup merged in: budgeted trees
        with_learned = "learned" in model.drafter.parts()
        trees = budgeted_candidates(budgeted.learned, budgeted.num_nodes, budgeted.lookup_depth, with_learned)
        rows = time_trees(model, timing, trees, max_new_tokens)
        best = fastest(rows)["budget"]
        return {"kind": "budgeted", "label": best, "spec": trees[best], "timings": rows, "topk": None}
    if not kind_of(model.drafter).static_trees:  # a drafter that grows its own trees: dynamic trees
        trees = dynamic_candidates(dynamic_grid)
        rows = time_trees(model, timing, trees, max_new_tokens)
        best = fastest(rows)["budget"]
        return {"kind": "dynamic", "label": best, "spec": trees[best], "timings": rows, "topk": None}
    budget = parse_budget(budget)
    topk = depth_topk_accuracy(model, greedy_sequences(model, prompts, max_new_tokens), k_max)
    trees = trees_for_budgets(topk, list(budgets) if budget == "auto" else [budget])
    rows = []
    if budget == "auto":
        rows = time_trees(model, timing, trees, max_new_tokens)
        for row in rows:
            row["predicted_tau"] = predicted_tau(trees[row["budget"]], topk)
        budget = fastest(rows)["budget"]
    paths = trees[budget]
    return {
        "kind": "static",
        "label": budget,
        "spec": paths,
        "timings": rows,
        "topk": topk,
        "predicted_tau": predicted_tau(paths, topk),
    }
