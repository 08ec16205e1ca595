"""The bf16 dot-product kernel of compiled CPU graphs (forward/cpu/bf16_linear.py): correctly rounded products to one
bf16 unit, the same bits for a row at any row count and thread count, the layer swap sharing the weights, and clear
errors for inputs it does not take. Skipped where the CPU has no AVX512-BF16."""

import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from medusa_like.forward.cpu import bf16_linear

from .conftest import at_one_and_two_threads

pytestmark = pytest.mark.skipif(bf16_linear.unavailable() is not None, reason=f"{bf16_linear.unavailable()}")

SHAPES = [(96, 64), (45, 37), (576, 1536), (33, 576), (1, 2)]  # [N, K]: odd K, N off the 32-output blocks


def product(x, weight, bias=None):
    return torch.ops.medusa_like.bf16_linear(x, bf16_linear.pack(weight), bias, weight.shape[0])


def operands(n, k, rows=70, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    return x, weight, bias


@pytest.mark.parametrize("shape", SHAPES)
def test_products_are_correctly_rounded_to_one_bf16_unit(shape):
    x, weight, bias = operands(*shape)
    k = shape[1]
    for b in (None, bias):
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())  # [M, N]
        got = product(x, weight, b).double()
        unit = exact.abs().clamp_min(1e-30) * 2**-7  # one bf16 unit (8 significant bits) at each value
        # an fp32 sum of k + 1 terms may be off by up to (k + 1) fp32 units of its terms' magnitude: where the terms
        # cancel to a value far smaller than they are, that exceeds the result's own unit, in any fp32 summation order
        # (the AMX tiles' and the dot products' alike)
        magnitude = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
        assert ((got - exact).abs() <= unit + (k + 1) * 2**-24 * magnitude).all()
        assert (got == exact.float().bfloat16().double()).float().mean() > 0.99  # rounding slips are rare


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_gets_the_same_bits_at_any_row_count(shape):
    x, weight, bias = operands(*shape)
    every = product(x, weight, bias)  # [70, N]
    for rows in (1, 2, 3, 7, 8, 9, 16, 31, 64):
        assert torch.equal(product(x[:rows], weight, bias), every[:rows])
    assert torch.equal(product(x[5:6], weight, bias), every[5:6])  # a row alone, taken from the middle


def has_amx() -> bool:
    return Path("/proc/cpuinfo").is_file() and "amx_bf16" in Path("/proc/cpuinfo").read_text().split()


@pytest.mark.skipif(not has_amx(), reason="needs a CPU with AMX")
def test_on_a_cpu_with_amx_whole_32s_of_k_run_on_tiles_and_the_rest_on_dot_products():
    """The shapes above then cover both paths (K = 64, 576, 1536 on tiles; 37 and 2 not): their bits were checked
    at every row count."""
    assert all(bf16_linear.on_tiles(k) for k in (32, 64, 576, 1536))
    assert not any(bf16_linear.on_tiles(k) for k in (2, 37, 48, 1000))


def test_the_thread_count_changes_no_bit():
    one, two = at_one_and_two_threads(product, *operands(576, 1536))
    assert torch.equal(one, two)


def test_leading_dimensions_are_kept():
    x, weight, _ = operands(96, 64)
    y = product(x.reshape(1, 70, 64), weight)
    assert y.shape == (1, 70, 96) and torch.equal(y[0], product(x, weight))


def test_the_swap_shares_every_weight_and_leaves_other_dtypes_alone():
    model = nn.Sequential(nn.Linear(64, 32).bfloat16(), nn.Linear(32, 8)).eval()  # bf16, then fp32
    traced = bf16_linear.with_packed_linears(model)
    assert isinstance(traced[0], bf16_linear.PackedLinear) and type(traced[1]) is nn.Linear
    assert traced[0].weight is model[0].weight and traced[0].bias is model[0].bias
    assert type(model[0]) is nn.Linear  # the original is unchanged
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(traced[0](x), F.linear(x, model[0].weight, model[0].bias))  # eagerly: F.linear


def test_a_compiled_layer_runs_the_kernel_on_a_folded_pack(tmp_path):
    layer = nn.Linear(64, 45).bfloat16().eval()
    traced = bf16_linear.with_packed_linears(nn.Sequential(layer))
    x = torch.randn(5, 64).bfloat16()
    rows = torch.export.Dim("rows", min=2, max=64)
    with torch.no_grad():
        program = torch.export.export(traced, (x,), dynamic_shapes=[{0: rows}], strict=False)
        targets = [str(node.target) for node in program.graph.nodes]
        assert "medusa_like.bf16_linear.default" in targets
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(tmp_path / "layer.pt2"), inductor_configs={"freezing": True}
        )
    with zipfile.ZipFile(path) as package:  # the generated code: no padding or permuting of the weight left in it
        code = "".join(package.read(n).decode() for n in package.namelist() if n.endswith(".cpp"))
    assert "bf16_linear" in code and "permute" not in code and "constant_pad_nd" not in code
    run = torch._inductor.aoti_load_package(path)
    assert torch.equal(run(x), product(x, layer.weight, layer.bias))
    assert torch.equal(run(x[:2]), run(x)[:2])


@pytest.mark.parametrize(
    "x, packed, out_features, message",
    [
        (torch.zeros(2, 64), bf16_linear.pack(torch.zeros(32, 64).bfloat16()), 32, "bfloat16"),
        (torch.zeros(2, 64).bfloat16(), torch.zeros(2, 32, 32, 2).bfloat16(), 96, "not of a"),
        (torch.zeros(2, 64).bfloat16(), torch.zeros(32, 64).bfloat16(), 32, "packed must be"),
        (torch.zeros(2, 62).bfloat16(), bf16_linear.pack(torch.zeros(32, 64).bfloat16()), 32, "not of a"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(x, packed, out_features, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.medusa_like.bf16_linear(x, packed, None, out_features)


def test_the_build_is_kept_under_its_key_in_the_user_cache():
    from medusa_like.io import user_cache_dir

    directory = bf16_linear.KERNEL.directory()
    assert directory.parent == user_cache_dir() / "kernels" and directory.name.startswith("bf16_linear-")
    assert len(list(directory.glob("*.so"))) == 1
