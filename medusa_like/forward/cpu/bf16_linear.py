"""bf16 products of a step's few rows by the CPU's bf16 dot product (AVX512-BF16), the same bits at any row count:
the compiled step's, and the eager few-row layers' of a bf16 model.

    reason = bf16_linear.unavailable()          # None where the kernel runs (an AVX512-BF16 CPU, the kernel built)
    traced = with_packed_linears(model)         # a copy whose bf16 linear layers run the kernel in compiled graphs
    y = torch.ops.medusa_like.bf16_linear(x, pack(weight), bias, out_features)   # x [..., K] -> [..., N], bf16
    on_tiles(576)                               # whether a product over K = 576 runs on AMX tiles here

Inductor's C++ GEMM template computes bf16 products by turning each weight it loads into fp32 and multiplying in fp32:
at one to four rows it streams the weights near the memory's speed, but from five rows on a bf16 step costs more than
an fp32 one (docs/cpu-kernels.md), so a bf16 target's trees stayed small. oneDNN's packed bf16 product multiplies in
bf16, but costs half as much again at one to four rows. This kernel (`bf16_linear.cpp`) multiplies bf16 pairs with
`vdpbf16ps` over a weight packed in blocks of 32 outputs (`pack`): the whole step costs what the template's does at
one to four nodes and a third of it at 32 (docs/cpu-kernels.md). Each output is one fp32 sum over the weight's
k-pairs in order, whatever the row count or the thread, so a tree row gets the bits of its one-node step, as the
attention kernel does (`tree_attention.py`): the step stays exact against greedy decoding on the same step.

On a CPU with AMX the same op multiplies a weight whose K is a multiple of 32 by tiles (`tdpbf16ps`, 16 rows at a
time over the same pack): each row's sums still depend on its own row alone, so the contract holds, and 16 to 64 rows
cost little more than one (docs/cpu-kernels.md). Which of the two runs depends on K and the machine, not on the rows.

In a compiled graph the pack is a function of a frozen weight, so the compiler folds it into a constant once; run
eagerly (a prompt's prefill through the same copy), a `PackedLinear` computes `F.linear` instead of packing at every
call. The eager step's few-row layers keep a pack of their own and compute every bf16 product on it
(`few_row_linear.bf16_pack`): oneDNN's bf16 pack, which they ran before, gave a row of a 4-row product other bits than
the row alone, and tree methods left greedy decoding on the eager bf16 step. Accuracy: the products are exact in fp32
and summed in fp32, like oneDNN's: its outputs are within one bf16 unit, as often correctly rounded as oneDNN's.
"""

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from .extension import Extension
from .layer_swap import copy_replacing

log = logging.getLogger(__name__)

OP = "medusa_like::bf16_linear"
LABEL = "bf16 dot-product kernel"  # how logs and compiled steps' labels name it
BLOCK = 32  # outputs of a packed block (bf16_linear.cpp's kBlockN)


def _shape(x, packed, bias, out_features):
    """The op's output for tracing: x's shape with `out_features` last, bf16, contiguous."""
    return x.new_empty((*x.shape[:-1], out_features))


KERNEL = Extension("bf16_linear", fakes={OP: _shape})


@functools.cache
def unavailable() -> str | None:
    """None where the kernel runs (built and loaded once per process), else why not: this CPU has no bf16 dot
    product, or the kernel could not be built (logged once per process, with what computes the products instead)."""
    if (why := cpu_unsupported()) is not None:
        return why
    why = KERNEL.load()
    if why is not None:
        log.warning(
            "%s: bf16 products run on Inductor's C++ GEMM template in compiled steps and on oneDNN's bf16 pack in eager "
            "ones, which may round a tree row apart from its one-node step",
            why,
        )
    return why


def cpu_unsupported() -> str | None:
    """Why this CPU cannot run the kernel (no AVX512-BF16 dot product), or None."""
    if not getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "this CPU has no AVX512-BF16 dot product"
    return None


def on_tiles(in_features: int) -> bool:
    """Whether a product over `in_features` runs on AMX tiles here (the kernel loaded: `unavailable()` is None)."""
    return bool(torch.ops.medusa_like.bf16_linear_on_tiles(in_features))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 32), ceil(K / 2), 32, 2]: blocks of 32 outputs, K in pairs (zero-padded)."""
    n, k = weight.shape
    padded = F.pad(weight, (0, k % 2, 0, -n % BLOCK))  # [N', K']
    blocks, pairs = padded.shape[0] // BLOCK, padded.shape[1] // 2
    return padded.reshape(blocks, BLOCK, pairs, 2).permute(0, 2, 1, 3).contiguous()


class PackedLinear(nn.Module):
    """A bf16 `nn.Linear` for compiled graphs, sharing the original's parameters: traced, its product runs the kernel
    over the packed weight (folded into a constant by freezing); eagerly, `F.linear`."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if torch.compiler.is_compiling():
            return torch.ops.medusa_like.bf16_linear(x, pack(self.weight), self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)


def runs_packed(module: nn.Module) -> bool:
    """Whether `module` is a linear layer whose product the kernel computes: bf16 weights on a CPU."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, nn.Linear)  # few-row layers are too
        and weight is not None
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
    )


def with_packed_linears(model: nn.Module) -> nn.Module:
    """A copy of `model` whose bf16 CPU linear layers (`nn.Linear`, or few-row ones) are `PackedLinear`s, sharing
    every parameter and buffer with `model` (no weight is copied; `model` is unchanged): what a compiled graph
    traces where the kernel runs."""
    return copy_replacing(model, lambda child: PackedLinear(child) if runs_packed(child) else None)
