"""Few-row linear layers: the same products as nn.Linear on this CPU's kernels, a row's bits at any row count, packs
remade when a weight changes, swapped in without copies, and lossless decoding with them."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medusa_like.decoding.cost_model import CostModelMismatchError, InvalidCostModelError
from medusa_like.drafters.registry import kind_named
from medusa_like.forward import prepare_target
from medusa_like.forward.cost_measure import measure_cost_model
from medusa_like.forward.cpu import few_row_linear, fp32_linear, read_kernel
from medusa_like.forward.cpu.few_row_linear import (
    DOT,
    FP32_DOT,
    MAX_ROWS,
    ONEDNN,
    FewRowLinear,
    bf16_pack,
    linear_kernel,
    onednn_packs_available,
    use_few_row_linears,
    with_stock_linears,
    worth_swapping,
)
from medusa_like.model import MedusaLikeModel
from tests.conftest import (
    assert_greedy_or_near_tie,
    random_heads,
    random_prompts,
    stock_greedy,
    tiny_target,
    untouched_target,
)

needs_onednn = pytest.mark.skipif(not onednn_packs_available(), reason="torch built without oneDNN")
needs_fp32_kernel = pytest.mark.skipif(
    fp32_linear.unavailable() is not None, reason="no AVX2: fp32 layers keep nn.Linear"
)
BF16_PACK = bf16_pack(torch.zeros(1, dtype=torch.bfloat16))  # what bf16 layers run on here: DOT, ONEDNN or None


@pytest.mark.parametrize("rows", [1, 2, 3, 7, MAX_ROWS, MAX_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fp32_kernel", [True, False])  # a target's layers, a drafter's (weight-first)
def test_few_row_linear_computes_the_same_product(rows, bias, fp32_kernel):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias)
    few_row = FewRowLinear.sharing(linear)
    use_few_row_linears(few_row, fp32_kernel=fp32_kernel)
    x = torch.randn(1, rows, 48)  # [B, T, H]
    torch.testing.assert_close(few_row(x), linear(x), rtol=1e-5, atol=1e-5)


@needs_fp32_kernel
def test_an_fp32_row_gets_the_same_bits_at_any_row_count_and_a_prompt_runs_on_onednn():
    """A step's rows (1..MAX_ROWS) run the fp32 kernel: a row's product does not depend on the rows beside it (what
    makes a tree node round as its one-node step); more rows run oneDNN's pack where torch has it."""
    target = tiny_target("llama", tie_word_embeddings=False)
    use_few_row_linears(target)
    layer = target.model.layers[0].mlp.down_proj
    assert layer.fp32_kernel and set(layer.packs.packs) == {FP32_DOT, *([ONEDNN] if onednn_packs_available() else [])}
    x = torch.randn(1, MAX_ROWS, layer.in_features)  # [B, T, H]
    rows = torch.cat([layer(x[:, i : i + 1]) for i in range(MAX_ROWS)], 1)
    assert torch.equal(rows, layer(x)) and torch.equal(layer(x[:, :5]), rows[:, :5])
    many = torch.randn(1, MAX_ROWS + 3, layer.in_features)
    torch.testing.assert_close(layer(many), F.linear(many, layer.weight), rtol=1e-5, atol=1e-5)


def test_packs_are_remade_when_the_weight_changes_and_not_copied():
    target = tiny_target("llama", tie_word_embeddings=False)
    use_few_row_linears(target)
    layer = target.model.layers[0].mlp.up_proj
    for rows in (3, MAX_ROWS + 2):
        x = torch.randn(1, rows, layer.in_features)
        with torch.no_grad():
            layer.weight.mul_(2)  # a pack of the old weight would give half the product
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert copy.deepcopy(layer).packs.packs == {}  # a copy does not copy the packs
    with torch.inference_mode():  # weights made under inference mode keep no version counter
        made = FewRowLinear(layer.in_features, layer.out_features, bias=False)
        use_few_row_linears(made)
        torch.testing.assert_close(made(x), F.linear(x, made.weight), rtol=1e-5, atol=1e-5)


def test_fp32_layers_keep_nn_linear_where_the_fp32_kernel_does_not_run(monkeypatch):
    """A CPU without AVX2 (or without a compiler): nothing to swap fp32 layers for; the eager step runs nn.Linear."""
    monkeypatch.setattr(fp32_linear, "unavailable", lambda: "no AVX2")
    assert not worth_swapping(tiny_target("llama"))
    model = MedusaLikeModel(tiny_target("llama"), None, random_heads())
    assert linear_kernel(model.target) == "nn.Linear"


@pytest.mark.skipif(BF16_PACK is None, reason="no AVX512-BF16 or AMX: bf16 layers keep nn.Linear's kernel")
def test_bf16_layers_run_on_one_pack_for_every_row_count_and_a_row_gets_the_same_bits_in_any():
    """One pack a layer (the dot-product kernel's where the CPU has AVX512-BF16, else oneDNN's), made at the swap,
    serves every row count; on the kernel's a row's product does not depend on the rows beside it (oneDNN's bf16 pack
    gave a row of a 4-row down projection other bits than alone)."""
    target = tiny_target("llama", tie_word_embeddings=False).to(torch.bfloat16)
    assert worth_swapping(target)
    use_few_row_linears(target)
    layer = target.model.layers[0].mlp.up_proj
    assert set(layer.packs.packs) == {BF16_PACK}
    for rows in (1, 3, 16, MAX_ROWS + 1):
        x = torch.randn(1, rows, layer.in_features, dtype=torch.bfloat16)  # [B, T, H]
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.6e-2, atol=1e-2)
        if BF16_PACK == DOT:
            assert torch.equal(torch.cat([layer(x[:, i : i + 1]) for i in range(rows)], 1), layer(x))
    with torch.no_grad():
        layer.weight.mul_(2)  # a pack of the old weight would give half the product
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.6e-2, atol=1e-2)
    use_few_row_linears(target)  # idempotent: bf16 layers keep their pack, and need no other
    assert set(layer.packs.packs) == {BF16_PACK}
    assert linear_kernel(target) == "few_row" and linear_kernel(with_stock_linears(target)) == "nn.Linear"


def test_bf16_layers_are_swapped_only_where_a_bf16_pack_runs(monkeypatch):
    target = tiny_target("llama")
    assert worth_swapping(target) == (fp32_linear.unavailable() is None)  # fp32: where the fp32 kernel runs
    monkeypatch.setattr(few_row_linear.bf16_linear, "unavailable", lambda: "no AVX512-BF16")
    monkeypatch.setattr(few_row_linear, "onednn_bf16_packs_available", lambda: False)
    assert not worth_swapping(target.to(torch.bfloat16)) and bf16_pack(target.lm_head.weight) is None
    monkeypatch.setattr(few_row_linear, "onednn_bf16_packs_available", lambda: True)  # AMX without AVX512-BF16
    assert worth_swapping(target) and bf16_pack(target.lm_head.weight) == ONEDNN
    monkeypatch.setattr(few_row_linear.bf16_linear, "unavailable", lambda: None)
    assert worth_swapping(target) and bf16_pack(target.lm_head.weight) == DOT
    monkeypatch.setattr(few_row_linear, "PACK_MEMORY_SHARE", 0.0)  # a pack of every weight would not fit
    assert not worth_swapping(target)


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
    target = tiny_target("qwen2")
    model = MedusaLikeModel(target, None, kind_named("eagle3").fresh(target), drafter_dtype=None)
    assert linear_kernel(model.target) == "few_row"
    assert all(m.fp32_kernel for m in model.target.modules() if isinstance(m, FewRowLinear))  # row-invariant
    drafter = [m for m in model.drafter.modules() if isinstance(m, (nn.Linear, FewRowLinear))]
    assert drafter and all(type(m) is FewRowLinear and not m.fp32_kernel for m in drafter)  # weight-first
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


def test_a_cost_model_written_before_steps_were_named_is_refused_saying_to_measure_again():
    """Tree files of an earlier version name no step (eager or compiled): what their times were measured on is unknown."""
    target = tiny_target("llama")
    prepared = prepare_target(target, tuned_layers=True)
    old = measure_cost_model(prepared, sizes=(1, 2), prefix=8, repeats=1).to_json()
    del old["step"]
    with pytest.raises(InvalidCostModelError, match=r"missing fields \['step'\] \(written by an earlier version"):
        prepared.load_cost_model(old, "file:old.json")


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
    assert layers and all(m.many_from == MAX_ROWS + 1 and ONEDNN in m.packs.packs for m in layers)
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
    layer.fp32_kernel, layer.many_from = True, 2
    for rows in (1, 3, MAX_ROWS + 5):
        assert layer(torch.empty(rows, 48, device="meta")).shape == (rows, 32)
    assert len(layer.packs) == 0


def test_a_cost_model_of_an_earlier_kernel_record_is_refused_saying_to_measure_again():
    """Cost models of versions that chose a kernel per tree size recorded `rows` and `prefill`: those kernels are
    gone, so their times do not hold."""
    prepared = prepare_target(tiny_target("llama"), tuned_layers=True)
    cost = measure_cost_model(prepared, sizes=(1, 2), prefix=8, repeats=1).to_json()
    assert cost["kernels"] == {"linears": "few_row"}
    old = cost | {"kernels": {"linears": "few_row", "rows": {"1": "weight_first"}, "prefill": None}}
    with pytest.raises(InvalidCostModelError, match="another version of this project: measure the cost model again"):
        prepared.load_cost_model(old, "file:old.json")
