"""Calibrating the heads and choosing a tree: per-head top-k accuracy, best trees per node budget, timed budgets.

    topk = head_topk_accuracy(model, sequences)           # teacher-forced over the target's own greedy answers
    trees = trees_for_budgets(topk, [4, 8, 16, 32])        # greedy best-first trees (`tree.greedy_tree`)
    rows = time_trees(model, prompts, trees, 128)          # tau and tokens/s per budget, interleaved per prompt
    best = fastest(rows)                                   # what `tree=auto` keeps

A budget counts candidate nodes, the root (the target's own next token) excluded: budget 0 is plain decoding.
"""

import time
from collections.abc import Callable, Sequence

import torch

from .metrics import median, rank_accuracy, rank_counts, summarize_decode, target_ranks, topk_from_counts
from .tree import TokenTree, expected_acceptance, greedy_tree

Path_ = tuple[int, ...]


# ---------------------------------------------------------------------------------------------------------------------
# Head accuracy


@torch.inference_mode()
def head_rank_counts(
    model, sequence: torch.Tensor, prompt_len: int, k_max: int = 10, chunk: int = 64
) -> list[list[int]]:
    """Per head, `metrics.rank_counts` of the right token over the answer part of one sequence [1, L].

    From the target's last hidden state at position t (t >= prompt_len - 1), head k (1-based) should predict token
    t + 1 + k; positions whose target falls past the end are skipped.
    """
    target, heads = model.target, model.heads
    lm_head = target.get_output_embeddings()
    hidden = target.base_model(input_ids=sequence).last_hidden_state[0]  # [L, H]
    length = sequence.shape[1]
    counts = [[0] * (k_max + 1) for _ in range(heads.num_heads)]
    positions = torch.arange(prompt_len - 1, length - 2)  # t with t + 2 < L: head 1 has a label
    for start in range(0, positions.numel(), chunk):
        t = positions[start : start + chunk]
        logits = heads(hidden[t], lm_head)  # [K, n, V]
        for k in range(1, heads.num_heads + 1):
            valid = t + 1 + k < length
            ranks = target_ranks(logits[k - 1][valid], sequence[0, t[valid] + 1 + k])  # [n_k]
            counts[k - 1] = [a + b for a, b in zip(counts[k - 1], rank_counts(ranks, k_max), strict=True)]
    return counts


def head_topk_accuracy(model, sequences: Sequence[tuple[torch.Tensor, int]], k_max: int = 10) -> list[list[float]]:
    """(sequence [1, L], prompt length) pairs -> topk[k][j] = top-(j+1) accuracy of head k+1, pooled over positions."""
    pooled = None
    for sequence, prompt_len in sequences:
        counts = head_rank_counts(model, sequence, prompt_len, k_max)
        pooled = (
            counts
            if pooled is None
            else [[a + b for a, b in zip(p, c, strict=True)] for p, c in zip(pooled, counts, strict=True)]
        )
    if pooled is None or pooled[0][-1] == 0:
        raise ValueError("head accuracy needs at least one answer longer than the number of heads")
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


def time_call(fn: Callable[[], int]) -> tuple[int, float]:
    """(new tokens, wall seconds) of fn(), which returns the number of new tokens."""
    start = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - start


def time_trees(
    model,
    prompts: Sequence[torch.Tensor],
    trees: dict[int, list[Path_]],
    max_new_tokens: int,
    eos_token_id=None,
    progress: Callable[[], None] | None = None,
) -> list[dict]:
    """Run every tree on every prompt, interleaved per prompt after one warm-up pass on the first prompt.

    Returns one row per budget: budget, nodes, measured tau and mean accepted draft tokens, median tokens/s.
    """
    if not prompts:
        raise ValueError("timing trees needs at least one prompt")

    compiled = {b: TokenTree.from_paths(paths, model.heads.num_heads) for b, paths in trees.items()}

    def run(ids, tree, limit=max_new_tokens):
        return model.generate(ids, max_new_tokens=limit, tree=tree, eos_token_id=eos_token_id)

    for tree in compiled.values():  # warm-up: allocator, kernels, thread pools
        run(prompts[0], tree, min(max_new_tokens, 8))
    stats: dict[int, list[dict]] = {b: [] for b in trees}
    speeds: dict[int, list[float]] = {b: [] for b in trees}
    for i, ids in enumerate(prompts):
        order = list(trees)
        order = order[i % len(order) :] + order[: i % len(order)]  # rotate so no budget always runs first
        for b in order:
            out = None

            def call(b=b, ids=ids):
                nonlocal out
                out = run(ids, compiled[b])
                return out.stats.new_tokens

            n, seconds = time_call(call)
            stats[b].append(out.stats.as_dict())
            speeds[b].append(n / seconds)
        if progress is not None:
            progress()
    rows = []
    for b, paths in trees.items():
        summary = summarize_decode(stats[b])
        rows.append(
            {
                "budget": b,
                "nodes": len(paths) + 1,
                "depth": max((len(p) for p in paths), default=0),
                "tau": summary["tau"],
                "mean_accepted_draft": summary["mean_accepted_draft"],
                "tokens_per_second": median(speeds[b]),
            }
        )
    return rows


def fastest(rows: Sequence[dict]) -> dict:
    """The row with the highest median tokens/s (ties: the smaller budget)."""
    if not rows:
        raise ValueError("no timed budgets to choose from")
    return max(rows, key=lambda r: (r["tokens_per_second"], -r["budget"]))
