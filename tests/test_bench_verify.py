"""The verification benchmark's split of a forward's time: every profiled operator lands in one part, and a tree
forward on the few-row layers spends time in products and in attention."""

import pytest

from eval.bench_verify import split, where_time_goes
from medusa_like.model import MedusaLikeModel
from medusa_like.tiny import tiny_chat_target


class Event:
    def __init__(self, key: str, self_us: float):
        self.key, self.self_cpu_time_total = key, self_us


def test_split_puts_each_operator_in_one_part_per_forward():
    events = [
        Event("aten::mm", 4000.0),
        Event("mkldnn::_linear_pointwise", 2000.0),
        Event("aten::_scaled_dot_product_flash_attention_for_cpu", 1000.0),
        Event("aten::mul", 600.0),
        Event("aten::linear", 400.0),  # the wrapper's own time: dispatch, not the product
    ]
    parts = split(events, forwards=2)
    assert parts == pytest.approx({"products": 3.0, "attention": 0.5, "rest": 0.5, "total": 4.0})


@pytest.mark.slow
def test_where_time_goes_on_a_tiny_target():
    target, tokenizer = tiny_chat_target("llama", hidden_size=64, num_layers=2)
    model = MedusaLikeModel.from_pretrained(target, drafter="lookup", tokenizer=tokenizer, tuned_layers=True)
    rows = where_time_goes(model.forward, [1, 3], repeats=2)
    assert [r["nodes"] for r in rows] == [1, 3]
    for r in rows:
        assert r["products"] > 0 and r["attention"] > 0 and r["wall_ms"] > 0
        assert r["total"] == pytest.approx(r["products"] + r["attention"] + r["rest"])
