"""The timing harness shared by evaluation, tree search and the core benchmark: warm-up first, methods interleaved
in an order rotated per prompt, per-prompt tokens/s, medians."""

import pytest
import torch

from medusa_like.evaluation.methods import METHODS, REFERENCE, SPECULATIVE
from medusa_like.evaluation.timing import (
    WARMUP_TOKENS,
    alternating_medians,
    geometric_mean_tps,
    median_tps,
    ms_table,
    rotated,
    time_methods,
    warm_up,
)


def recording_runners(calls: list, names=("a", "b", "c")):
    """Runners that record (name, prompt length, max_new_tokens) and return that many tokens of the prompt's length."""

    def make(name):
        def run(ids: torch.Tensor, max_new_tokens: int):
            calls.append((name, ids.shape[1], max_new_tokens))
            return [ids.shape[1]] * max_new_tokens, {"new_tokens": max_new_tokens}

        return run

    return {name: make(name) for name in names}


def test_warm_up_then_every_prompt_in_rotated_order():
    calls = []
    prompts = [torch.zeros(1, n, dtype=torch.long) for n in (3, 4, 5, 6)]
    results = time_methods(recording_runners(calls), prompts, max_new_tokens=WARMUP_TOKENS + 5)
    warm = [("a", 3, WARMUP_TOKENS), ("b", 3, WARMUP_TOKENS), ("c", 3, WARMUP_TOKENS)]
    assert calls[:3] == warm  # warm-up: the first prompt, few tokens, untimed
    timed = calls[3:]
    orders = [[name for name, _, _ in timed[i : i + 3]] for i in range(0, len(timed), 3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert [length for _, length, _ in timed] == [3] * 3 + [4] * 3 + [5] * 3 + [6] * 3
    assert all(n == WARMUP_TOKENS + 5 for _, _, n in timed)
    assert list(results) == ["a", "b", "c"]
    for runs in results.values():
        assert [r["tokens"][0] for r in runs] == [3, 4, 5, 6]  # one result per prompt, in prompt order
        for r in runs:
            assert r["tps"] == pytest.approx(len(r["tokens"]) / r["seconds"])
        middle = sorted(r["tps"] for r in runs)[1:3]  # four prompts: the median is the mean of the middle two
        assert median_tps(runs) == pytest.approx(sum(middle) / 2)


def test_geometric_mean_counts_every_prompt():
    # three prompts: the median is the middle one whatever the others do; the geometric mean moves with each
    a = [{"tps": 10.0}, {"tps": 20.0}, {"tps": 40.0}]
    b = [{"tps": 10.0}, {"tps": 20.0}, {"tps": 80.0}]
    assert geometric_mean_tps(a) == pytest.approx(20.0)
    assert median_tps(a) == median_tps(b) and geometric_mean_tps(b) > geometric_mean_tps(a)
    # a paired ranking: scaling every prompt of one method by r scales its geometric mean by r
    assert geometric_mean_tps([{"tps": 1.1 * r["tps"]} for r in a]) == pytest.approx(1.1 * geometric_mean_tps(a))
    with pytest.raises(ValueError, match="no results"):
        geometric_mean_tps([])


def test_warm_up_is_short_but_never_longer_than_the_answer():
    calls = []
    ids = torch.zeros(1, 3, dtype=torch.long)
    warm_up(recording_runners(calls, names=("a",)), ids, max_new_tokens=96)
    warm_up(recording_runners(calls, names=("a",)), ids, max_new_tokens=2)
    assert calls == [("a", 3, WARMUP_TOKENS), ("a", 3, 2)] and WARMUP_TOKENS < 96


def test_rotation_and_refusals():
    assert rotated(["x", "y", "z"], 4) == ["y", "z", "x"]
    with pytest.raises(ValueError, match="at least one prompt"):
        time_methods(recording_runners([]), [], max_new_tokens=1)
    with pytest.raises(ValueError, match="at least one method"):
        time_methods({}, [torch.zeros(1, 2, dtype=torch.long)], max_new_tokens=1)


def test_the_methods_registry_names_the_reference_and_the_evaluated_method():
    assert REFERENCE in METHODS and SPECULATIVE in METHODS
    assert len({m.label for m in METHODS.values()}) == len(METHODS)  # the report's tables tell them apart


def test_alternating_medians_measure_the_subjects_in_turn_and_take_each_columns_median():
    order = []
    values = {"a": iter([[1.0, 9.0], [3.0, 7.0], [2.0, 8.0]]), "b": iter([[5.0, 0.0], [4.0, 1.0], [6.0, 2.0]])}

    def measure(name):
        order.append(name)
        return next(values[name])

    medians = alternating_medians(measure, {"a": "a", "b": "b"}, rounds=3)
    assert order == ["a", "b"] * 3  # round after round, not one subject's rounds in a row
    assert medians == {"a": [2.0, 8.0], "b": [5.0, 1.0]}
    table = ms_table("t", "linears", [1, 2], medians)
    assert [c.header for c in table.columns] == ["linears", "1", "2"] and table.row_count == 2
