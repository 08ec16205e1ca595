"""Few-row linear layers: the same products as nn.Linear by every kernel a row plan may name, swapped in without copies,
row plans measured once per shape and cached, and lossless decoding with them."""

import copy
import json
import logging
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medusa_like.decoding.cost_model import CostModel, CostModelMismatchError, InvalidCostModelError
from medusa_like.decoding.projection import VocabProjection
from medusa_like.drafters.registry import kind_named
from medusa_like.forward import prepare_target
from medusa_like.forward.cost_measure import measure_cost_model
from medusa_like.forward.cpu import few_row_linear, read_kernel, row_plans
from medusa_like.forward.cpu.few_row_linear import (
    ANY_ROWS,
    DOT,
    KERNEL_ROWS,
    MAX_ROWS,
    ONEDNN,
    PREFILL_KERNELS,
    ROW_KERNELS,
    FewRowLinear,
    WeightPacks,
    bf16_pack,
    few_row_product,
    kernel_rows,
    linear_kernel,
    mkl_packs_available,
    onednn_packs_available,
    set_prefill_kernel,
    set_row_kernel,
    sync_packs,
    usable_row_kernels,
    use_few_row_linears,
    weight_first_linear,
    with_stock_linears,
    worth_swapping,
)
from medusa_like.forward.cpu.kernel_choice import apply_kernels, every_row_count, pick_row_kernels
from medusa_like.forward.cpu.row_plans import PLANNED_ROWS, measure_row_plan, row_plan, valid_plan
from medusa_like.model import MedusaLikeModel
from tests.conftest import (
    assert_greedy_or_near_tie,
    random_heads,
    random_prompts,
    stock_greedy,
    tiny_target,
    untouched_target,
)

# the tests of row plans and the kernel choice per size: fp32 layers run them where the fp32 kernel does not
pytestmark = pytest.mark.usefixtures("fp32_row_plans")


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


needs_mkl = pytest.mark.skipif(not mkl_packs_available(), reason="torch built without MKL")


needs_onednn = pytest.mark.skipif(not onednn_packs_available(), reason="torch built without oneDNN")


def random_plan(seed: int, packed: bool = False, onednn: bool = False) -> tuple[int, ...]:
    """A plan naming every kind of kernel: F.linear (0), weight-first over the rows, over padded rows, with `packed`
    MKL's packed sgemm over the rows padded to a pack's row count (-m), and with `onednn` oneDNN's pack (ONEDNN)."""
    rng = random.Random(seed)
    plan = []
    for n in range(1, PLANNED_ROWS + 1):
        choices = [0, n, rng.randint(n, PLANNED_ROWS)]
        if packed and n <= KERNEL_ROWS:
            choices.append(kernel_rows("packed", n, 0))
        if onednn:
            choices.append(ONEDNN)
        plan.append(rng.choice(choices))
    return tuple(plan)


def packed_plan() -> tuple[int, ...]:
    """A plan that runs MKL's packed sgemm wherever a pack serves the rows (1..KERNEL_ROWS), F.linear beyond."""
    return tuple(kernel_rows("packed", n, 0) if n <= KERNEL_ROWS else 0 for n in range(1, PLANNED_ROWS + 1))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 13, KERNEL_ROWS, KERNEL_ROWS + 1, 50, PLANNED_ROWS, MAX_ROWS + 1])
def test_every_kernel_a_plan_names_computes_the_same_product(rows):
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(80, 48), torch.randn(80), torch.randn(1, rows, 48)  # x [B, T, H]
    transposed = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same rows, as a weight-first product leaves them
    expected = F.linear(x, weight, bias)
    packed, onednn = mkl_packs_available(), onednn_packs_available()
    plans = [random_plan(seed, packed, onednn) for seed in range(6)]
    if rows <= PLANNED_ROWS:  # force the padded path, the packed one and oneDNN's for this row count
        plans.append(tuple(PLANNED_ROWS if n == rows else 0 for n in range(1, PLANNED_ROWS + 1)))
        if packed:
            plans.append(packed_plan())
        if onednn:
            plans.append((ONEDNN,) * PLANNED_ROWS)
    packs = WeightPacks()
    for plan in plans:
        for rows_in in (x, transposed):
            for prefill in (0, ONEDNN) if onednn else (0,):  # a prefill's kernel: F.linear or oneDNN
                out = few_row_product(rows_in, weight, bias, plan, packs, prefill)
                assert out.shape == expected.shape
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not packed or rows > KERNEL_ROWS or len(packs) > 0
    assert not onednn or ANY_ROWS in packs.packs


@needs_mkl
def test_packs_are_made_when_needed_remade_when_the_weight_changes_and_released_when_unused():
    target = tiny_target("llama", tie_word_embeddings=False)
    use_few_row_linears(target)
    layer = target.model.layers[0].mlp.up_proj
    x = torch.randn(1, 5, layer.in_features)
    set_row_kernel(target, 5, "packed")
    assert layer.plan[4] == -8 and len(layer.packs) == 0  # made when first run, not when planned
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert set(layer.packs.packs) == {8}
    with torch.no_grad():
        layer.weight.mul_(2)  # a pack of the old weight would give the old product
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert copy.deepcopy(layer).packs.packs == {}  # a copy does not copy the packs
    set_row_kernel(target, 12, "packed")
    sync_packs(target)  # what the plans run is made now, for every layer
    assert set(layer.packs.packs) == {8, 16} and set(target.model.layers[1].mlp.up_proj.packs.packs) == {8, 16}
    set_row_kernel(target, 5, "planned")
    sync_packs(target)
    assert set(layer.packs.packs) == {16}
    with torch.inference_mode():  # weights made under inference mode keep no version counter
        made = FewRowLinear(layer.in_features, layer.out_features, bias=False)
        made.plan = packed_plan()
        torch.testing.assert_close(made(x), F.linear(x, made.weight), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_onednn_row_kernel_runs_one_pack_for_every_row_count_it_is_set_for():
    target = tiny_target("llama", tie_word_embeddings=False)
    use_few_row_linears(target)
    layer = target.model.layers[0].mlp.up_proj
    set_row_kernel(target, 3, "onednn")
    set_row_kernel(target, 7, "onednn")
    assert layer.plan[2] == layer.plan[6] == ONEDNN and len(layer.packs) == 0  # made when first run
    for rows in (3, 7):
        x = torch.randn(1, rows, layer.in_features)  # [B, T, H]
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert set(layer.packs.packs) == {ANY_ROWS}  # one pack serves both row counts
    with torch.no_grad():
        layer.weight.mul_(2)  # a pack of the old weight would give half the product
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    sync_packs(target)  # every layer gets the pack its plan runs
    assert all(ANY_ROWS in m.packs.packs for m in target.modules() if isinstance(m, FewRowLinear))
    set_row_kernel(target, 3, "planned")
    set_row_kernel(target, 7, "linear")
    set_prefill_kernel(target, "onednn")
    sync_packs(target)  # a prefill still runs it
    assert layer.prefill == ONEDNN and set(layer.packs.packs) == {ANY_ROWS}
    x = torch.randn(1, MAX_ROWS + 3, layer.in_features)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    set_prefill_kernel(target, "linear")
    sync_packs(target)  # nothing names it any more: released
    assert layer.prefill == 0 and len(layer.packs) == 0
    with pytest.raises(ValueError, match="unknown prefill kernel"):
        set_prefill_kernel(target, "packed")


BF16_PACK = bf16_pack(torch.zeros(1, dtype=torch.bfloat16))  # what bf16 layers run on here: DOT, ANY_ROWS or None


@pytest.mark.skipif(BF16_PACK is None, reason="no AVX512-BF16 or AMX: bf16 layers keep nn.Linear's kernel")
def test_bf16_layers_run_on_one_pack_for_every_row_count_and_a_row_gets_the_same_bits_in_any():
    """One pack a layer (the dot-product kernel's where the CPU has AVX512-BF16, else oneDNN's), made at the swap,
    serves every row count; on the kernel's a row's product does not depend on the rows beside it (oneDNN's bf16 pack
    gave a row of a 4-row down projection other bits than alone)."""
    target = tiny_target("llama", tie_word_embeddings=False).to(torch.bfloat16)
    assert worth_swapping(target)
    use_few_row_linears(target)
    layer = target.model.layers[0].mlp.up_proj
    assert layer.plan == () and set(layer.packs.packs) == {BF16_PACK}  # fp32's row plans not needed
    for rows in (1, 3, 16, MAX_ROWS + 1):
        x = torch.randn(1, rows, layer.in_features, dtype=torch.bfloat16)  # [B, T, H]
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.6e-2, atol=1e-2)
        if BF16_PACK == DOT:
            assert torch.equal(torch.cat([layer(x[:, i : i + 1]) for i in range(rows)], 1), layer(x))
    with torch.no_grad():
        layer.weight.mul_(2)  # a pack of the old weight would give half the product
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.6e-2, atol=1e-2)
    sync_packs(target)  # bf16 layers keep their pack, and need no other
    assert set(layer.packs.packs) == {BF16_PACK}
    assert linear_kernel(target) == "few_row" and linear_kernel(with_stock_linears(target)) == "nn.Linear"


def test_bf16_layers_are_swapped_only_where_a_bf16_pack_runs(monkeypatch):
    target = tiny_target("llama")
    assert worth_swapping(target)  # fp32 on a CPU: always
    monkeypatch.setattr(few_row_linear.bf16_linear, "unavailable", lambda: "no AVX512-BF16")
    monkeypatch.setattr(few_row_linear, "onednn_bf16_packs_available", lambda: False)
    assert not worth_swapping(target.to(torch.bfloat16)) and bf16_pack(target.lm_head.weight) is None
    monkeypatch.setattr(few_row_linear, "onednn_bf16_packs_available", lambda: True)  # AMX without AVX512-BF16
    assert worth_swapping(target) and bf16_pack(target.lm_head.weight) == ANY_ROWS
    monkeypatch.setattr(few_row_linear.bf16_linear, "unavailable", lambda: None)
    assert worth_swapping(target) and bf16_pack(target.lm_head.weight) == DOT
    monkeypatch.setattr(few_row_linear, "PACK_MEMORY_SHARE", 0.0)  # a pack of every weight would not fit
    assert not worth_swapping(target)


def test_packed_kernels_are_offered_only_where_their_library_and_memory_allow(monkeypatch):
    target = tiny_target("llama")
    use_few_row_linears(target)
    assert ("packed" in usable_row_kernels(target)) == mkl_packs_available()
    assert ("onednn" in usable_row_kernels(target)) == onednn_packs_available()
    monkeypatch.setattr(few_row_linear, "onednn_packs_available", lambda: False)
    assert "onednn" not in usable_row_kernels(target)
    monkeypatch.setattr(few_row_linear, "PACK_MEMORY_SHARE", 0.0)
    assert usable_row_kernels(target) == tuple(k for k in ROW_KERNELS if k not in ("packed", "onednn"))


def test_a_measured_plan_is_valid_and_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_LIKE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(row_plans, "_PLANS", {})
    weight = torch.randn(40, 24)
    plan = row_plan(weight)
    assert valid_plan(plan)
    stored = json.loads((tmp_path / "row_plans.json").read_text())
    assert stored == {row_plans.plan_key(weight): list(plan)}

    # a later process reads the plan from the file instead of measuring it: plant another valid plan there
    planted = random_plan(7)
    (tmp_path / "row_plans.json").write_text(json.dumps({row_plans.plan_key(weight): list(planted)}))
    monkeypatch.setattr(row_plans, "_PLANS", {})
    assert row_plan(weight) == planted
    assert row_plan(torch.randn(24, 40)) != () and len(json.loads((tmp_path / "row_plans.json").read_text())) == 2


@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"key": [1, 2]}', "\udcff"])
def test_an_unreadable_or_invalid_plan_cache_is_measured_again(tmp_path, monkeypatch, content):
    monkeypatch.setenv("MEDUSA_LIKE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(row_plans, "_PLANS", {})
    (tmp_path / "row_plans.json").write_text(content, errors="surrogateescape")
    weight = torch.randn(40, 24)
    assert valid_plan(row_plan(weight))
    stored = json.loads((tmp_path / "row_plans.json").read_text())
    assert list(stored) == [row_plans.plan_key(weight)]  # rewritten whole: only valid entries
    assert not list(tmp_path.glob(".row_plans.json.tmp-*"))


def test_measured_plans_name_only_valid_kernels():
    for shape in [(8, 8), (96, 32), (32, 96)]:
        plan = measure_row_plan(torch.randn(*shape), repeats=1)
        assert valid_plan(plan)
        assert all(m == 0 or m >= n for n, m in enumerate(plan, 1))
    assert not valid_plan((0,) * (PLANNED_ROWS - 1))
    assert not valid_plan(tuple(n - 1 for n in range(1, PLANNED_ROWS + 1)))  # fewer rows than it has


def test_plans_are_timed_over_distinct_copies_of_the_weight_that_fill_the_cold_budget():
    weight = torch.randn(40, 24)  # 3840 bytes
    copies = row_plans.cold_copies(weight, total_bytes=10 * 3840)
    cycle = [next(copies) for _ in range(21)]
    assert cycle[0] is weight and cycle[10] is weight and cycle[20] is weight  # 10 tensors, each read once a round
    assert len({t.data_ptr() for t in cycle[:10]}) == 10
    assert all(torch.equal(t, weight) for t in cycle)
    big = row_plans.cold_copies(weight, total_bytes=1)
    assert next(big) is weight and next(big) is not weight and next(big) is weight  # never fewer than two


def test_a_stock_copy_has_nn_linears_sharing_the_parameters_and_leaves_the_model_unchanged():
    target = tiny_target("llama", tie_word_embeddings=False)
    use_few_row_linears(target)
    few_row = [name for name, m in target.named_modules() if isinstance(m, FewRowLinear)]
    stock = with_stock_linears(target)
    assert [name for name, m in target.named_modules() if isinstance(m, FewRowLinear)] == few_row  # unchanged
    assert linear_kernel(target) == "few_row" and linear_kernel(stock) == "nn.Linear"
    assert not any(isinstance(m, FewRowLinear) for m in stock.modules())
    assert {n: p.data_ptr() for n, p in stock.named_parameters()} == {
        n: p.data_ptr() for n, p in target.named_parameters()
    }
    ids = torch.randint(0, target.config.vocab_size, (1, 6))
    torch.testing.assert_close(stock(ids).logits, target(ids).logits, rtol=1e-4, atol=1e-4)


def test_swapped_layers_and_the_vocabulary_projection_carry_their_weights_plans():
    target = tiny_target("llama", tie_word_embeddings=False)
    use_few_row_linears(target)
    layers = [m for m in target.modules() if isinstance(m, FewRowLinear)]
    assert layers and all(m.plan == row_plan(m.weight) for m in layers)
    projection = VocabProjection(target)  # calls the swapped output layer, which runs its own plan
    assert isinstance(target.lm_head, FewRowLinear) and valid_plan(target.lm_head.plan)
    hidden = torch.randn(5, target.config.hidden_size)
    torch.testing.assert_close(projection(hidden), F.linear(hidden, target.lm_head.weight), rtol=1e-5, atol=1e-5)
    unplanned = tiny_target("llama")
    use_few_row_linears(unplanned, plans=False)
    assert all(m.plan == () for m in unplanned.modules() if isinstance(m, FewRowLinear))


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
    stock = MedusaLikeModel(tiny_target("qwen2"), None, random_heads(), tuned_layers=False)
    assert linear_kernel(stock.target) == "nn.Linear"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
@pytest.mark.parametrize("drafter", ["medusa", "eagle3", "lookup"])
def test_decoding_with_few_row_linears_equals_the_targets_greedy(family, drafter):
    """Random Medusa heads (static tree), a random EAGLE-3 drafter (dynamic tree) and lookup (budgeted tree)."""
    target = tiny_target(family)
    fresh = random_heads(num_heads=3) if drafter == "medusa" else kind_named(drafter).fresh(target)
    model = MedusaLikeModel(target, None, fresh, backend="sdpa", tuned_layers=True)
    tree = "small" if drafter == "medusa" else "dynamic"
    accepted = 0
    prompts = random_prompts(4, seed=3)
    for ids, expected in zip(prompts, stock_greedy(untouched_target(family), prompts, 24), strict=True):
        out = model.generate(ids, max_new_tokens=24, tree=tree, eos_token_id=[])
        assert out.new_tokens.tolist() == expected
        accepted += sum(out.stats.accepted_draft)
    if drafter == "lookup":  # tiny random targets repeat themselves: lookup drafts get accepted
        assert accepted > 0


@pytest.mark.skipif(BF16_PACK is None, reason="no AVX512-BF16 or AMX: bf16 layers keep nn.Linear's kernel")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("drafter", ["eagle3", "lookup"])
def test_bf16_decoding_on_bf16_packs_equals_the_targets_greedy(family, drafter):
    """In bf16 the tree's rows and greedy's single row run on the same packs, and attend by the row-invariant kernel
    where it builds: trees give plain decoding's tokens on the same layers, and those are transformers' own greedy
    tokens of an untouched bf16 copy up to near-ties (two bf16 forwards round apart; a wrong pack differs by whole
    logits)."""
    target = tiny_target(family).to(torch.bfloat16)
    model = MedusaLikeModel(target, None, kind_named(drafter).fresh(target))
    assert set(model.target.model.layers[0].mlp.up_proj.packs.packs) == {BF16_PACK}
    untouched = untouched_target(family, dtype=torch.bfloat16)
    prompts = random_prompts(3, seed=5)
    for ids, theirs in zip(prompts, stock_greedy(untouched, prompts, 24), strict=True):
        plain = model.generate(ids, max_new_tokens=24, tree="none", eos_token_id=[]).new_tokens.tolist()
        assert_greedy_or_near_tie(untouched, ids, plain, theirs)
        out = model.generate(ids, max_new_tokens=24, tree="dynamic", eos_token_id=[])
        assert out.new_tokens.tolist() == plain


def test_a_cost_model_measured_with_other_linears_is_refused():
    stock = prepare_target(tiny_target("llama"), tuned_layers=False)
    stock_cost = measure_cost_model(stock, sizes=(1, 4), prefix=8, repeats=1)
    assert stock.load_cost_model(stock_cost.to_json(), "file").kernels["linears"] == "nn.Linear"
    tuned = prepare_target(tiny_target("llama"), tuned_layers=True)  # the same weights, this CPU's layers
    with pytest.raises(CostModelMismatchError, match="linears"):
        tuned.load_cost_model(stock_cost.to_json(), "file")


def test_a_row_kernel_changes_only_its_row_count_in_every_planned_layer():
    target = tiny_target("llama", tie_word_embeddings=False)
    use_few_row_linears(target)
    layers = [m for m in target.modules() if isinstance(m, FewRowLinear)]
    own = {id(m): m.plan for m in layers}
    set_row_kernel(target, 5, "padded")
    set_row_kernel(target, 3, "weight_first")
    for m in layers:
        assert m.plan[4] == 8 and m.plan[2] == 3 and valid_plan(m.plan)
        assert [e for n, e in enumerate(m.plan) if n not in (2, 4)] == [
            e for n, e in enumerate(own[id(m)]) if n not in (2, 4)
        ]
    set_row_kernel(target, 5, "planned")
    assert all(m.plan[4] == own[id(m)][4] for m in layers)
    assert [kernel_rows("padded", n, 0) for n in (1, 2, 3, 9, 32)] == [1, 2, 4, 16, 32]
    with pytest.raises(ValueError, match="unknown row kernel"):
        set_row_kernel(target, 2, "fastest")
    with pytest.raises(ValueError, match="1..32"):
        set_row_kernel(target, KERNEL_ROWS + 1, "planned")
    with pytest.raises(ValueError, match="MKL packs serve 1..32"):
        kernel_rows("packed", KERNEL_ROWS + 1, 0)
    assert kernel_rows("linear", 7, 8) == 0


def test_a_cost_models_kernels_cover_the_row_counts_between_its_sizes():
    """A cost model measures some tree sizes and interpolates between them: a row count it does not name runs the
    kernel of the next larger size it names (past the largest, the largest's), never the layers' own plans."""
    target = tiny_target("llama", tie_word_embeddings=False)
    use_few_row_linears(target)
    apply_kernels({"linears": "few_row", "rows": {"1": "linear", "4": "weight_first", "6": "padded"}}, target)
    assert every_row_count({"4": "padded", "1": "linear"}) == {1: "linear", **dict.fromkeys(range(2, 33), "padded")}
    for m in few_row_layers(target):
        assert m.plan[:6] == (0, 2, 3, 4, 8, 8)  # F.linear; weight-first over 2, 3, 4; padded to 8 for 5 and 6
        assert m.plan[8] == 16 and m.plan[16] == 32 and m.plan[31] == 32  # past 6: padded, the largest size's


def few_row_layers(model) -> list[FewRowLinear]:
    return [m for m in model.modules() if isinstance(m, FewRowLinear)]


def with_kernels(cost: CostModel, rows: list[str] | None = None, prefill="keep") -> dict:
    """`cost`'s JSON with other row kernels for its sizes, or another prefill kernel."""
    kernels = dict(cost.kernels)
    if rows is not None:
        kernels["rows"] = {str(n): kernel for n, kernel in zip(cost.nodes, rows, strict=False)}
    if prefill != "keep":
        kernels["prefill"] = prefill
    return cost.to_json() | {"kernels": kernels}


def test_the_cost_model_picks_a_row_kernel_per_size_and_sets_it_where_it_is_loaded(monkeypatch):
    measured = tiny_target("llama")
    cost = measure_cost_model(
        prepare_target(measured, tuned_layers=True), sizes=(1, 3, 5), prefix=MAX_ROWS + 8, repeats=1
    )
    rows = cost.kernels["rows"]
    assert list(rows) == ["1", "3", "5"] and set(rows.values()) <= set(ROW_KERNELS)
    down = measured.model.layers[0].mlp.down_proj
    own = row_plan(down.weight)
    for size in cost.nodes:  # the measured target runs what was picked
        assert down.plan[size - 1] == kernel_rows(rows[str(size)], size, own[size - 1])
    for count, size in ((2, 3), (4, 5), (6, 5), (32, 5)):  # and between and past the sizes, the next (or last) pick
        assert down.plan[count - 1] == kernel_rows(rows[str(size)], count, own[count - 1])

    loaded = tiny_target("llama")  # same seed and config: the same target in another process
    load = prepare_target(loaded, tuned_layers=True).load_cost_model
    load(with_kernels(cost, ["weight_first", "padded", "padded"]), "file")
    assert [loaded.model.layers[1].mlp.down_proj.plan[n - 1] for n in (1, 3, 5)] == [1, 4, 8]
    for bad in ({"1": "padded", "33": "linear"}, {"1": "planned", "5": "fastest"}, ["padded"]):
        with pytest.raises(InvalidCostModelError, match="rows"):
            load(cost.to_json() | {"kernels": {**cost.kernels, "rows": bad}}, "file")
    with_packs = with_kernels(cost, ["planned", "packed", "packed"])
    if mkl_packs_available():
        load(with_packs, "file")
        assert [loaded.model.layers[1].mlp.down_proj.plan[n - 1] for n in (3, 5)] == [-4, -8]
    prefill = cost.kernels["prefill"]
    assert prefill in PREFILL_KERNELS and down.prefill == (ONEDNN if prefill == "onednn" else 0)
    with_onednn = with_kernels(cost, ["linear", "onednn", "onednn"], prefill="onednn")
    if onednn_packs_available():
        load(with_onednn, "file")
        loaded_down = loaded.model.layers[1].mlp.down_proj
        assert [loaded_down.plan[n - 1] for n in (1, 3, 5)] == [0, ONEDNN, ONEDNN] and loaded_down.prefill == ONEDNN
        assert set(loaded_down.packs.packs) == {ANY_ROWS}  # made where it is loaded
        load(with_kernels(cost, prefill="linear"), "file")
        assert loaded_down.prefill == 0
    with pytest.raises(InvalidCostModelError, match="prefill"):
        load(with_kernels(cost, prefill="packed"), "file")
    # measured where MKL and oneDNN were, loaded where they are not
    monkeypatch.setattr(few_row_linear, "mkl_packs_available", lambda: False)
    monkeypatch.setattr(few_row_linear, "onednn_packs_available", lambda: False)
    only_prefill = with_kernels(cost, ["linear"] * 3, prefill="onednn")
    for unusable in (with_packs, with_onednn, only_prefill):
        with pytest.raises(CostModelMismatchError, match="cannot run here"):
            load(unusable, "file")
    # not picking: the kernels as they are, named so that another copy of the target runs the same (first set to
    # kernels that run everywhere: the timed picks above may have named MKL's or oneDNN's, patched away now)
    load(with_kernels(cost, ["weight_first", "padded", "padded"], prefill="linear"), "file")
    loaded_prepared = prepare_target(loaded)
    as_they_are = measure_cost_model(loaded_prepared, sizes=(1, 2), prefix=8, repeats=1, pick_kernels=False)
    assert set(as_they_are.kernels["rows"]) == {"1", "2"}
    again = tiny_target("llama")
    prepare_target(again, tuned_layers=True).load_cost_model(as_they_are.to_json(), "file")
    for ours, theirs in zip(few_row_layers(loaded), few_row_layers(again), strict=True):
        assert ours.plan[:2] == theirs.plan[:2]
    short = measure_cost_model(loaded_prepared, sizes=(1, 2), prefix=8, repeats=1)  # no prefill kernel computes it
    assert short.kernels["rows"] is not None and short.kernels["prefill"] == "linear"  # kept as it was


def test_a_cost_model_written_before_steps_were_named_is_refused_saying_to_measure_again():
    """Tree files of an earlier version name no step (eager or compiled): what their times were measured on is unknown."""
    target = tiny_target("llama")
    prepared = prepare_target(target, tuned_layers=True)
    old = measure_cost_model(prepared, sizes=(1, 2), prefix=8, repeats=1).to_json()
    del old["step"]
    with pytest.raises(InvalidCostModelError, match=r"missing fields \['step'\] \(written by an earlier version"):
        prepared.load_cost_model(old, "file:old.json")


def test_a_row_kernel_replaces_transformers_own_product_only_where_it_is_clearly_faster():
    target = tiny_target("llama")
    use_few_row_linears(target)
    kernels = ("linear", "planned", "weight_first")
    medians = {  # ms per (size, kernel): size 1 within 3% of F.linear, size 2 well under it, size 3 F.linear fastest
        (1, "linear"): 10.0, (1, "planned"): 9.8, (1, "weight_first"): 9.9,
        (2, "linear"): 12.0, (2, "planned"): 12.5, (2, "weight_first"): 10.0,
        (3, "linear"): 11.0, (3, "planned"): 11.5, (3, "weight_first"): 12.0,
    }  # fmt: skip
    assert pick_row_kernels(target, (1, 2, 3), medians, kernels) == ["linear", "weight_first", "linear"]
    layer = target.model.layers[0].self_attn.q_proj
    assert layer.plan[:3] == (0, 2, 0) and len(layer.plan) == PLANNED_ROWS


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kernel", ["mixed", *ROW_KERNELS])
def test_decoding_with_any_row_kernels_equals_the_targets_greedy(family, kernel):
    """Every size on one row kernel, or each size on a random one ("mixed"); prompts long enough to be prefilled by the
    prefill kernel (oneDNN's with "onednn", else F.linear)."""
    target = tiny_target(family)
    model = MedusaLikeModel(target, None, kind_named("lookup").fresh(target), backend="sdpa", tuned_layers=True)
    kernels = usable_row_kernels(model.target)
    if kernel not in ("mixed", *kernels):
        pytest.skip(f"the {kernel} row kernel cannot run here")
    rng = random.Random(5)
    for size in range(1, KERNEL_ROWS + 1):
        set_row_kernel(model.target, size, rng.choice(kernels) if kernel == "mixed" else kernel)
    set_prefill_kernel(model.target, "onednn" if kernel == "onednn" else "linear")
    prompts = random_prompts(3, seed=8, min_len=MAX_ROWS + 1, max_len=2 * MAX_ROWS)
    for ids, expected in zip(prompts, stock_greedy(untouched_target(family), prompts, 24), strict=True):
        out = model.generate(ids, max_new_tokens=24, tree="dynamic", eos_token_id=[])
        assert out.new_tokens.tolist() == expected


@needs_onednn
def test_training_reads_the_target_on_onednn_with_the_same_hidden_states():
    """`use_read_kernel` (training's teacher-forced read): the decoder's products over many rows run on oneDNN's pack,
    giving the stock hidden states up to fp32 rounding; the head keeps nn.Linear; `linear` changes nothing; an
    unknown name is refused."""
    target = tiny_target("llama")
    ids = torch.randint(0, target.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = target.base_model(input_ids=ids, output_hidden_states=True).hidden_states
    assert not read_kernel.use_read_kernel(target.base_model, "linear")
    assert linear_kernel(target) == "nn.Linear"
    assert read_kernel.use_read_kernel(target.base_model, "auto")
    layers = [m for m in target.base_model.modules() if isinstance(m, FewRowLinear)]
    assert layers and all(m.prefill == ONEDNN and ANY_ROWS in m.packs.packs for m in layers)
    assert type(target.get_output_embeddings()) is nn.Linear
    with torch.no_grad():
        got = target.base_model(input_ids=ids, output_hidden_states=True).hidden_states
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"expected one of \['auto', 'onednn', 'linear'\], got 'mkl'"):
        read_kernel.use_read_kernel(target.base_model, "mkl")


@needs_onednn
def test_a_read_whose_pack_would_not_fit_in_memory_keeps_f_linear_or_is_refused(monkeypatch, caplog):
    """oneDNN's pack is a second copy of every weight: where it would not fit, `auto` keeps nn.Linear (no pack made)
    and says so; asked from two rows on (the compiled step's prompt read: tests/test_compiled.py) it keeps nn.Linear
    too; and `onednn` is refused with what to set instead."""
    target = tiny_target("llama")
    monkeypatch.setattr(few_row_linear, "PACK_MEMORY_SHARE", 0.0)
    with caplog.at_level(logging.INFO):
        assert not read_kernel.use_read_kernel(target.base_model, "auto")
    assert "would not fit in memory: the model's many-row reads keep F.linear" in caplog.text
    assert not read_kernel.use_read_kernel(target.base_model, "auto", from_rows=2)
    assert linear_kernel(target) == "nn.Linear"
    with pytest.raises(ValueError, match="second copy of every weight.*use read_kernel=linear"):
        read_kernel.use_read_kernel(target.base_model, "onednn")
    assert linear_kernel(target) == "nn.Linear"


def test_a_target_that_trains_on_another_device_keeps_its_own_kernels():
    """A trainer on a GPU moves the target there after the train app builds it on the CPU: `use_read_kernel` told the
    device leaves nn.Linear (auto) or refuses (onednn), and a few-row layer that was moved anyway computes F.linear
    there, making no CPU pack (the meta device stands in for the GPU: no kernel of the CPU's runs on it)."""
    target = tiny_target("llama")
    assert not read_kernel.use_read_kernel(target.base_model, "auto", device="cuda")
    assert linear_kernel(target) == "nn.Linear"
    with pytest.raises(ValueError, match="needs an fp32 model on a CPU"):
        read_kernel.use_read_kernel(target.base_model, "onednn", device="cuda")
    layer = FewRowLinear.sharing(nn.Linear(48, 32)).to("meta")
    layer.plan, layer.prefill = (ONEDNN,) * PLANNED_ROWS, ONEDNN
    for rows in (1, 3, PLANNED_ROWS + 5):
        assert layer(torch.empty(rows, 48, device="meta")).shape == (rows, 32)
    assert len(layer.packs) == 0
