"""Static trees built from rank accuracies, and the named presets (`tree=chain | small | medusa`).

`rank_accuracy[d][r]` is the probability that the drafter's rank-r token at depth d+1 is the right one. Under
independent depths a path of ranks is accepted with the product of its ranks' probabilities, so the expected number
of accepted draft tokens of a tree is the sum of those products over its paths (`expected_acceptance`), and adding
nodes best-first maximises it (`greedy_tree`). The presets are greedy trees for a prior shaped like measured
Medusa-1 heads; `tree_files.resolve_tree` turns a preset's name into a `TokenTree`.
"""

import heapq

import torch

Path_ = tuple[int, ...]


def target_ranks(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [..., V], targets [...] -> rank of each target among its logits [...] (0 = the argmax; ties count
    against the target only when strictly greater): what rank accuracies are measured from."""
    right = logits.gather(-1, targets.unsqueeze(-1))  # [..., 1]
    return (logits > right).sum(-1)


def chain(depth: int) -> list[Path_]:
    """Top-1 of each head, one after the other: [[0], [0, 0], ...]."""
    return [(0,) * d for d in range(1, depth + 1)]


def greedy_tree(rank_accuracy: list[list[float]], num_nodes: int) -> list[Path_]:
    """The tree of `num_nodes` candidate nodes that maximises expected acceptance length.

    `rank_accuracy[d][r]` is the probability that head d+1's rank-r token is the right one. Assuming heads are
    independent, a path is accepted with the product of its ranks' probabilities, and the expected number of accepted
    draft tokens is the sum of those products over the tree. Adding nodes best-first (a child is never more probable
    than its parent) gives the optimal tree for that objective, and always a valid one.
    """
    num_heads = len(rank_accuracy)
    frontier = [(-acc, (r,)) for r, acc in enumerate(rank_accuracy[0])] if num_heads else []
    heapq.heapify(frontier)
    chosen: list[Path_] = []
    while frontier and len(chosen) < num_nodes:
        neg_p, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < num_heads:
            for r, acc in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(frontier, (neg_p * acc, path + (r,)))
    return chosen


def expected_acceptance(paths, rank_accuracy: list[list[float]]) -> float:
    """Expected accepted draft tokens per step under independent heads (add 1 for the bonus token to get tau)."""
    total = 0.0
    for path in paths:
        p = 1.0
        for d, r in enumerate(path):
            p *= rank_accuracy[d][r] if r < len(rank_accuracy[d]) else 0.0
        total += p
    return total


# A prior used only to shape the presets: head d's rank-r accuracy falls with depth and rank, roughly as measured for
# Medusa-1 heads (top-1 about 0.6 for head 1, lower for later heads).
PRESET_PRIOR = [
    [0.60 * 0.55**r for r in range(10)],
    *[[(0.45 - 0.08 * d) * 0.6**r for r in range(10)] for d in range(4)],
]

DEFAULT_DEPTH = 4  # static presets for a drafter of any depth

PRESETS = {
    "chain": lambda num_heads: chain(num_heads),
    "small": lambda num_heads: greedy_tree(PRESET_PRIOR[: max(num_heads, 1)], 15),
    "medusa": lambda num_heads: greedy_tree(PRESET_PRIOR[: max(num_heads, 1)], 63),
}
