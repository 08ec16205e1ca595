"""How many nodes a step verifies: the n best-scored nodes, n maximising expected tokens per millisecond under this
machine's cost model of the verification forward (`decoding/cost_model.py`): shallow or none when little is likely,
deep along a long confident match.

    scores = path_scores(candidates)                    # each node's chance of acceptance: q multiplied along its path
    n, rate = best_rate(scores, cost, draft_ms)        # the best cut and its expected tokens per ms

Scores are non-increasing along a path, so the best n nodes are ancestor-closed: a tree the target can verify.
"""

from bisect import bisect_right

from medusa_like.decoding.cost_model import BatchShare, CostModel

OVERHEAD_MS = 1.0  # per step outside drafting and the verification forward: acceptance, commits, Python
CERTAINTY_EDGES = (0.05, 0.2, 0.5)  # the best lookup node's score, for the learned drafter's gate


def path_scores(candidates: dict) -> dict:
    """Each candidate's chance of being accepted: the product of q along its path (a path missing a parent drops)."""
    scores: dict[tuple[int, ...], float] = {}
    for path in sorted(candidates, key=len):
        parent = scores.get(path[:-1], 1.0 if len(path) == 1 else None)
        if parent is not None:
            scores[path] = parent * candidates[path].q
    return scores


def lookup_certainty(scores: dict) -> int:
    """A bucket of the best lookup node's chance of acceptance: 0 (nothing matched or below 5%) .. 3 (over 50%)."""
    return bisect_right(CERTAINTY_EDGES, max(scores.values(), default=0.0))


def best_rate(
    scores: dict, cost: CostModel, draft_ms: float, limit: int | None = None, shared: BatchShare | None = None
) -> tuple[int, float]:
    """(n, expected tokens per ms) of the best n-node cut: the n highest scores, n maximising the rate. In a batch
    (`shared`: what the other rows verify in the same forward), the forward is priced by the batch's nodes and the
    rate counts the batch's tokens (`BatchShare`)."""
    ordered = sorted(scores.values(), reverse=True)[:limit]
    verify = cost.verify if shared is None else lambda nodes: shared.verify(cost, nodes)
    expected = 1.0 + (0.0 if shared is None else shared.tokens)
    best_n, best = 0, expected / (verify(1) + draft_ms + OVERHEAD_MS)
    for n, score in enumerate(ordered, 1):
        expected += score
        rate = expected / (verify(n + 1) + draft_ms + OVERHEAD_MS)
        if rate > best:
            best_n, best = n, rate
    return best_n, best
