"""Linear layers for the few rows of a decoding step on a CPU.

A tree step multiplies a handful of rows (the verified nodes, or a drafter's top-k) by every weight of the model. x86
BLAS (MKL, as torch ships it) does this up to twice as fast when the weight is the left operand, `W @ x.T`, than in
`nn.Linear`'s orientation, `x @ W.T`: on a 2-core CPU the default target's linear layers take about as long for 2-6
rows as for 1 in the first orientation, and 1.5-2x as long in the second (`eval/bench_linear.py` measures it). One row
(greedy decoding) and long prefills keep `nn.Linear`'s own path.

The swap shares the original parameters (no copy, same state-dict keys) and changes only fp32 rounding, as any other
row count or kernel would: the target's greedy decoding stays the reference, computed with the same layers.
"""

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 64  # above this a product is a prefill: nn.Linear's own path, measured as fast


def weight_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(weight @ x.T).T`: x [..., in], weight [out, in] -> [..., out]."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    y = (weight @ flat.T).T  # [rows, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class FewRowLinear(nn.Linear):
    """`nn.Linear` (same parameters) that computes 2..MAX_ROWS rows as `(W @ x.T).T`."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> "FewRowLinear":
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if 2 <= x.numel() // self.in_features <= MAX_ROWS:
            return weight_first_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def worth_swapping(module: nn.Module) -> bool:
    """Measured on x86 CPUs in fp32; other devices and dtypes keep their own kernels."""
    weight = next(module.parameters(), None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32


def use_few_row_linears(model) -> int:
    """Replace every `nn.Linear` inside `model` (a module, or a drafter: anything with `.modules()`), in place, by a
    `FewRowLinear` sharing its parameters; returns how many were replaced. Idempotent."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                parent.register_module(name, FewRowLinear.sharing(child))
                swapped += 1
    return swapped


def linear_kernel(model: nn.Module) -> str:
    """What computes `model`'s linear layers ("few_row" or "nn.Linear"): a cost model is only valid for the same."""
    return "few_row" if any(isinstance(m, FewRowLinear) for m in model.modules()) else "nn.Linear"
