"""Evaluation metrics as pure functions over plain numbers and token lists (no model, no timing in here).

Definitions used in every report of this project:

    tau                  generated tokens / target forwards, summed over prompts. The prefill forward counts and the
                         bonus token counts, so plain decoding has tau = 1 exactly (as in Medusa, EAGLE, Spec-Bench).
    mean accepted draft  draft tokens accepted per tree step (the bonus token and the prefill excluded): the number some
                         papers call the acceptance length; it is NOT tau - 1 (the prefill forward shifts it slightly).
    tokens/s             new tokens / wall-clock seconds of the whole call (prefill included), per prompt; a method's
                         speed is the median over prompts.
    speedup              median tokens/s of a method / median tokens/s of the baseline; the median of the per-prompt
                         ratios (paired, robust to load drifting during the run) is reported beside it.
    lossless match       a prompt matches when the speculative tokens equal the reference's token for token: equal on
                         the shorter length AND of equal length (both stop at EOS or at max_new_tokens, so any length
                         difference is a divergence too). The losslessness fraction is the share of matching prompts.
    top-k accuracy       head k, teacher-forced on the target's greedy answer: from the hidden state at position t the
                         right token is token t + 1 + k; top-k = P(its rank among the head's logits < k).
"""

import statistics
from collections.abc import Iterable, Sequence

import torch

TOPK_MAX = 10  # top-1 .. top-TOPK_MAX accuracy is counted unless a caller asks for another depth

# ---------------------------------------------------------------------------------------------------------------------
# Acceptance


def tau(new_tokens: int, target_forwards: int) -> float:
    """Generated tokens per target forward (prefill and bonus token included)."""
    if target_forwards < 1:
        raise ValueError(f"tau needs at least one target forward, got {target_forwards}")
    return new_tokens / target_forwards


def summarize_decode(stats: Sequence[dict]) -> dict:
    """Pool per-prompt decode stats (`DecodeStats.as_dict()`) into tau and mean accepted draft tokens."""
    if not stats:
        raise ValueError("no decode stats to summarize")
    new_tokens = sum(s["new_tokens"] for s in stats)
    forwards = sum(s["target_forwards"] for s in stats)
    steps = sum(len(s["accepted_draft"]) for s in stats)
    accepted = sum(sum(s["accepted_draft"]) for s in stats)
    prefill = sum(s.get("prefill_seconds", 0.0) for s in stats)
    decode = sum(s.get("decode_seconds", 0.0) for s in stats)
    return {
        "prompts": len(stats),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "tree_steps": steps,
        "tau": tau(new_tokens, forwards),
        "mean_accepted_draft": accepted / steps if steps else 0.0,
        "acceptance_by_depth": acceptance_by_depth(stats),
        "draft_ms_per_step": 1000 * sum(s.get("draft_seconds", 0.0) for s in stats) / max(steps, 1),
        "verify_ms_per_step": 1000 * sum(s.get("verify_seconds", 0.0) for s in stats) / max(steps, 1),
        "prefill_share": prefill / (prefill + decode) if prefill + decode > 0 else 0.0,
    }


def acceptance_by_depth(stats: Sequence[dict]) -> list[float]:
    """[d-1] = share of tree steps that accepted at least d draft tokens (the draft's depth-d acceptance rate)."""
    values = [n for s in stats for n in s["accepted_draft"]]
    if not values:
        return []
    return [sum(v >= d for v in values) / len(values) for d in range(1, max(values) + 1)]


def accepted_histogram(stats: Sequence[dict], max_accepted: int | None = None) -> list[int]:
    """counts[n] = tree steps that accepted exactly n draft tokens, n = 0 .. max."""
    values = [n for s in stats for n in s["accepted_draft"]]
    size = (max(values, default=0) if max_accepted is None else max_accepted) + 1
    counts = [0] * size
    for n in values:
        if n >= size:
            raise ValueError(f"a step accepted {n} draft tokens, more than max_accepted={max_accepted}")
        counts[n] += 1
    return counts


def group_by(records: Iterable[dict], key: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(str(record[key]), []).append(record)
    return groups


# ---------------------------------------------------------------------------------------------------------------------
# Speed


def tokens_per_second(new_tokens: int, seconds: float) -> float:
    if seconds <= 0:
        raise ValueError(f"elapsed time must be positive, got {seconds}")
    return new_tokens / seconds


def median(values: Iterable[float]) -> float:
    values = list(values)
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def speedup(tps: float, baseline_tps: float) -> float:
    if baseline_tps <= 0:
        raise ValueError(f"baseline tokens/s must be positive, got {baseline_tps}")
    return tps / baseline_tps


def speed_summary(per_prompt: Sequence[dict[str, float]], baselines: Sequence[str]) -> dict:
    """per_prompt[i][method] = tokens/s -> medians per method and speedups of every method over each baseline."""
    if not per_prompt:
        raise ValueError("no timed prompts")
    methods = list(per_prompt[0])
    for b in baselines:
        if b not in methods:
            raise ValueError(f"baseline {b!r} was not timed; timed methods are {methods}")
    medians = {m: median(p[m] for p in per_prompt) for m in methods}
    ratios = {b: {m: speedup(medians[m], medians[b]) for m in methods if m != b} for b in baselines}
    paired = {b: {m: median(p[m] / p[b] for p in per_prompt) for m in methods if m != b} for b in baselines}
    return {"median_tokens_per_second": medians, "speedup": ratios, "paired_speedup": paired}


def batch_throughput(records: Sequence[dict], methods: Sequence[str]) -> dict | None:
    """At `eval.batch_size` > 1 (records whose methods carry their `batch`): the batch size and, per method, tokens/s
    in total, every prompt's new tokens over the wall seconds of the batches that decoded them (each prompt counting
    its share of its batch's seconds: seconds / size); None at batch size 1."""
    if not records or any("batch" not in r[m] for r in records for m in methods):
        return None
    total = {}
    for m in methods:
        tokens = sum(len(r[m]["tokens"]) for r in records)
        seconds = sum(r[m]["batch"]["seconds"] / r[m]["batch"]["size"] for r in records)
        total[m] = tokens_per_second(tokens, seconds)
    return {"batch_size": max(r[methods[0]]["batch"]["size"] for r in records), "tokens_per_second": total}


# ---------------------------------------------------------------------------------------------------------------------
# Losslessness


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first differing token, the shorter length when one is a strict prefix, None when identical."""
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def outputs_match(tokens: Sequence[int], reference: Sequence[int]) -> bool:
    """Equal on the shorter length and of equal length (see the module docstring)."""
    return first_divergence(tokens, reference) is None


def losslessness(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict:
    """pairs of (speculative tokens, reference tokens) -> the matching fraction and where each mismatch starts."""
    if not pairs:
        raise ValueError("no outputs to compare")
    divergences = [first_divergence(a, b) for a, b in pairs]
    mismatches = [i for i, d in enumerate(divergences) if d is not None]
    return {
        "fraction": 1.0 - len(mismatches) / len(pairs),
        "prompts": len(pairs),
        "mismatches": len(mismatches),
        "mismatch_index": mismatches,
        "first_divergence": [divergences[i] for i in mismatches],
    }


# ---------------------------------------------------------------------------------------------------------------------
# Head accuracy


def rank_counts(ranks: torch.Tensor, k_max: int = TOPK_MAX) -> list[int]:
    """ranks [N] -> counts[r] of ranks equal to r for r < k_max, and the total N as the last entry."""
    ranks = ranks.flatten()
    counts = torch.bincount(ranks.clamp(max=k_max), minlength=k_max + 1)[:k_max]
    return [int(c) for c in counts] + [ranks.numel()]


def topk_from_counts(counts: Sequence[int]) -> list[float]:
    """`rank_counts` output (possibly summed over batches) -> top-1 .. top-k_max accuracy."""
    *per_rank, total = counts
    if total < 1:
        raise ValueError("no positions counted")
    out, running = [], 0
    for c in per_rank:
        running += c
        out.append(running / total)
    return out


def rank_accuracy(topk: Sequence[float]) -> list[float]:
    """top-1 .. top-k accuracy -> P(the rank-r token is right) = top-(r+1) - top-r, what `greedy_tree` takes."""
    if any(b < a - 1e-12 for a, b in zip(topk[:-1], topk[1:], strict=True)):
        raise ValueError(f"top-k accuracies must not decrease with k, got {list(topk)}")
    return [topk[0], *(b - a for a, b in zip(topk[:-1], topk[1:], strict=True))] if topk else []
