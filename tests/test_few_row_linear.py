"""Few-row linear layers: the same products as nn.Linear, swapped in without copies, and lossless decoding with them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medusa_like.decoding.cost_model import CostModel, CostModelMismatchError, measure_cost_model
from medusa_like.decoding.few_row_linear import (
    MAX_ROWS,
    FewRowLinear,
    linear_kernel,
    use_few_row_linears,
    weight_first_linear,
)
from medusa_like.drafters.registry import kind_named
from medusa_like.model import MedusaLikeModel
from tests.conftest import greedy_reference, random_heads, random_prompts, tiny_target


@pytest.mark.parametrize("rows", [1, 2, 3, 7, MAX_ROWS, MAX_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_few_row_linear_computes_the_same_product(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias)
    few_row = FewRowLinear.sharing(linear)
    x = torch.randn(1, rows, 48)  # [B, T, H]
    torch.testing.assert_close(few_row(x), linear(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        weight_first_linear(x, linear.weight, linear.bias), F.linear(x, linear.weight, linear.bias)
    )


def test_swap_shares_parameters_keeps_ties_and_state_dict_and_is_idempotent():
    target = tiny_target("llama", tie_word_embeddings=True)
    before = copy.deepcopy(target.state_dict())
    linears = sum(type(m) is nn.Linear for m in target.modules())
    assert linears > 0 and linear_kernel(target) == "nn.Linear"
    assert use_few_row_linears(target) == linears
    assert not any(type(m) is nn.Linear for m in target.modules()) and linear_kernel(target) == "few_row"
    assert target.lm_head.weight is target.model.embed_tokens.weight
    after = target.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert use_few_row_linears(target) == 0


def test_on_by_default_for_fp32_cpu_targets_and_drafters_and_off_on_request():
    model = MedusaLikeModel(tiny_target("qwen2"), None, random_heads())
    assert linear_kernel(model.target) == "few_row"
    assert all(type(m) is not nn.Linear for m in model.drafter.modules())
    stock = MedusaLikeModel(tiny_target("qwen2"), None, random_heads(), few_row_linear=False)
    assert linear_kernel(stock.target) == "nn.Linear"


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
@pytest.mark.parametrize("drafter", ["medusa", "eagle3", "lookup"])
def test_decoding_with_few_row_linears_equals_the_targets_greedy(family, drafter):
    """Random Medusa heads (static tree), a random EAGLE-3 drafter (dynamic tree) and lookup (budgeted tree)."""
    target = tiny_target(family)
    fresh = random_heads(num_heads=3) if drafter == "medusa" else kind_named(drafter).fresh(target)
    model = MedusaLikeModel(target, None, fresh, backend="sdpa", few_row_linear=True)
    tree = "small" if drafter == "medusa" else "dynamic"
    accepted = 0
    for ids in random_prompts(4, seed=3):
        expected = greedy_reference(model.target, ids, 24)
        out = model.generate(ids, max_new_tokens=24, tree=tree, eos_token_id=[])
        assert out.new_tokens.tolist() == expected.tolist()
        accepted += sum(out.stats.accepted_draft)
    if drafter == "lookup":  # tiny random targets repeat themselves: lookup drafts get accepted
        assert accepted > 0


def test_a_cost_model_measured_with_other_linears_is_refused():
    target = tiny_target("llama")
    stock_cost = measure_cost_model(target, sizes=(1, 4), prefix=8, repeats=1)
    assert CostModel.from_json(stock_cost.to_json(), target).linears == "nn.Linear"
    use_few_row_linears(target)
    with pytest.raises(CostModelMismatchError, match="linears"):
        CostModel.from_json(stock_cost.to_json(), target)
