"""Metric arithmetic on synthetic decode stats and timings: tau, accepted draft tokens, speedups, losslessness, top-k."""

import pytest
import torch

from medusa_like.decoding.generate import DecodeStats
from medusa_like.decoding.tree_presets import target_ranks
from medusa_like.evaluation import metrics


def stats(new_tokens, forwards, accepted):
    return {"new_tokens": new_tokens, "target_forwards": forwards, "accepted_draft": accepted}


def test_tau_counts_prefill_and_bonus():
    # prefill gives 1 token; 3 tree steps accept 2, 0, 3 drafts + 1 bonus each -> 1 + 3 + 1 + 4 = 9 tokens, 4 forwards
    s = stats(9, 4, [2, 0, 3])
    assert metrics.tau(9, 4) == 2.25
    summary = metrics.summarize_decode([s])
    assert summary["tau"] == 2.25
    assert summary["mean_accepted_draft"] == pytest.approx(5 / 3)
    assert summary["tree_steps"] == 3


def test_plain_decoding_has_tau_one():
    assert metrics.summarize_decode([stats(7, 7, [0] * 6)])["tau"] == 1.0


def test_tau_pools_tokens_not_prompt_means():
    # 10 tokens / 2 forwards and 2 tokens / 2 forwards: pooled 12 / 4 = 3, not the mean of 5 and 1
    summary = metrics.summarize_decode([stats(10, 2, [8]), stats(2, 2, [0])])
    assert summary["tau"] == 3.0
    assert summary["mean_accepted_draft"] == 4.0


def test_summary_agrees_with_decode_stats():
    ds = DecodeStats(new_tokens=9, target_forwards=4, accepted_draft=[2, 0, 3])
    summary = metrics.summarize_decode([ds.as_dict()])
    assert summary["tau"] == ds.tau
    assert summary["mean_accepted_draft"] == ds.mean_accepted_draft


def test_prefill_share_pools_seconds_over_prompts():
    # 1 s of prefill and 1 s of decoding, then 0 and 6: 1 / 8 of the time, not the mean of per-prompt shares (1 / 4)
    timed = [
        {**stats(9, 4, [2, 0, 3]), "prefill_seconds": 1.0, "decode_seconds": 1.0},
        {**stats(9, 4, [2, 0, 3]), "prefill_seconds": 0.0, "decode_seconds": 6.0},
    ]
    assert metrics.summarize_decode(timed)["prefill_share"] == pytest.approx(1 / 8)
    assert metrics.summarize_decode([stats(9, 4, [2])])["prefill_share"] == 0.0  # untimed stats


def test_tau_errors():
    with pytest.raises(ValueError, match="at least one target forward"):
        metrics.tau(3, 0)
    with pytest.raises(ValueError, match="no decode stats"):
        metrics.summarize_decode([])


def test_accepted_histogram():
    assert metrics.accepted_histogram([stats(0, 0, [0, 2, 2]), stats(0, 0, [1])]) == [1, 1, 2]
    assert metrics.accepted_histogram([stats(0, 0, [1])], max_accepted=3) == [0, 1, 0, 0]
    with pytest.raises(ValueError, match="more than max_accepted"):
        metrics.accepted_histogram([stats(0, 0, [4])], max_accepted=3)


def test_group_by():
    groups = metrics.group_by([{"c": "a", "x": 1}, {"c": "b", "x": 2}, {"c": "a", "x": 3}], "c")
    assert {k: [r["x"] for r in v] for k, v in groups.items()} == {"a": [1, 3], "b": [2]}


def test_speed_summary_medians_and_speedups():
    per_prompt = [
        {"hf_greedy": 10.0, "hf_prompt_lookup": 12.0, "speculative": 20.0},
        {"hf_greedy": 20.0, "hf_prompt_lookup": 16.0, "speculative": 30.0},
        {"hf_greedy": 30.0, "hf_prompt_lookup": 20.0, "speculative": 60.0},
    ]
    out = metrics.speed_summary(per_prompt, ["hf_greedy", "hf_prompt_lookup"])
    assert out["median_tokens_per_second"] == {"hf_greedy": 20.0, "hf_prompt_lookup": 16.0, "speculative": 30.0}
    assert out["speedup"]["hf_greedy"]["speculative"] == 1.5
    assert out["speedup"]["hf_prompt_lookup"]["speculative"] == 30.0 / 16.0
    assert out["speedup"]["hf_greedy"]["hf_prompt_lookup"] == 0.8
    assert "hf_greedy" not in out["speedup"]["hf_greedy"]
    # paired: per-prompt ratios 2.0, 1.5, 2.0 -> median 2.0
    assert out["paired_speedup"]["hf_greedy"]["speculative"] == 2.0


def test_speed_errors():
    with pytest.raises(ValueError, match="baseline 'nope' was not timed"):
        metrics.speed_summary([{"a": 1.0}], ["nope"])
    with pytest.raises(ValueError, match="positive"):
        metrics.speedup(1.0, 0.0)
    with pytest.raises(ValueError, match="positive"):
        metrics.tokens_per_second(5, 0.0)
    assert metrics.tokens_per_second(5, 2.0) == 2.5


def test_losslessness_is_strict():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2  # a strict prefix still differs: lengths must agree
    assert metrics.first_divergence([1, 2, 3, 4], [1, 2, 3]) == 3
    assert metrics.outputs_match([], [])
    out = metrics.losslessness([([1, 2], [1, 2]), ([1, 2], [1, 3]), ([5], [5]), ([5], [5, 6])])
    assert out["fraction"] == 0.5
    assert out["mismatches"] == 2
    assert out["mismatch_index"] == [1, 3]
    assert out["first_divergence"] == [1, 1]
    with pytest.raises(ValueError, match="no outputs"):
        metrics.losslessness([])


def test_target_ranks_and_topk():
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.0], [0.3, 0.2, 0.1, 0.4]])  # [2, 4]
    ranks = target_ranks(logits, torch.tensor([2, 3]))
    assert ranks.tolist() == [1, 0]
    counts = metrics.rank_counts(torch.tensor([0, 0, 1, 3, 12]), k_max=3)
    assert counts == [2, 1, 0, 5]  # ranks 0, 1, 2 counted; 3 and 12 fall outside top-3; total 5
    assert metrics.topk_from_counts(counts) == [0.4, 0.6, 0.6]
    assert metrics.rank_accuracy([0.4, 0.6, 0.6]) == pytest.approx([0.4, 0.2, 0.0])
    with pytest.raises(ValueError, match="must not decrease"):
        metrics.rank_accuracy([0.5, 0.4])
    with pytest.raises(ValueError, match="no positions"):
        metrics.topk_from_counts([0, 0])
