"""Linear layers for the few rows of a decoding step on a CPU.

A tree step multiplies a handful of rows (the verified nodes, or a drafter's top-k) by every weight of the model. x86
BLAS (MKL, as torch ships it) does this up to twice as fast when the weight is the left operand, `W @ x.T`, than in
`nn.Linear`'s orientation, `x @ W.T`, and for some row counts faster still over a few zero rows more (16 rows cost
less than 13 on a 2-core AMD EPYC). Each `FewRowLinear` carries its weight's row plan (`row_plans.py`, measured once
per shape on this machine): for 1..32 rows, `F.linear` or weight-first over how many rows. Without a plan, 2..MAX_ROWS
rows go weight-first. Long prefills keep `nn.Linear`'s own path. `eval/bench_linear.py` measures the whole forward.

The swap shares the original parameters (no copy, same state-dict keys) and changes only fp32 rounding, as any other
row count or kernel would: the target's greedy decoding stays the reference, computed with the same layers.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .row_plans import PLANNED_ROWS, row_plan

MAX_ROWS = 64  # above this a product is a prefill: nn.Linear's own path, measured as fast


def weight_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(weight @ x.T).T`: x [..., in], weight [out, in] -> [..., out]."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    y = (weight @ flat.T).T  # [rows, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def few_row_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: tuple[int, ...] = ()
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the kernel `plan` names for x's row count (`row_plans.py`): 0 -> F.linear,
    m -> weight-first over the rows padded with zero rows to m. Row counts the plan does not cover: weight-first for
    2..MAX_ROWS, else F.linear."""
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS:
        return F.linear(x, weight, bias)
    # Rows in memory order, as the plan was timed: a weight-first product leaves its output transposed ([rows, out]
    # with strides (1, rows)), and MKL multiplies the next weight by such rows more slowly (README, few-row layers:
    # a 2-node forward of SmolLM2 took 48 ms without this copy and 37 ms with it).
    x = x.contiguous()
    padded = plan[rows - 1] if 0 < rows <= len(plan) else (rows if rows >= 2 else 0)
    if padded == 0:
        return F.linear(x, weight, bias)
    if padded == rows:
        return weight_first_linear(x, weight, bias)
    flat = F.pad(x.reshape(rows, -1), (0, 0, 0, padded - rows))  # [m, in]: zero rows after x's
    return weight_first_linear(flat, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])


class FewRowLinear(nn.Linear):
    """`nn.Linear` (same parameters) that computes few rows by its weight's row plan (`few_row_product`)."""

    plan: tuple[int, ...] = ()

    @classmethod
    def sharing(cls, linear: nn.Linear) -> "FewRowLinear":
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_row_product(x, self.weight, self.bias, self.plan)


# What computes n rows in every layer at once, chosen per row count by timing whole forwards (`cost_model.py`):
# each layer's own plan (timed one layer at a time), weight-first over the n rows, or over n rows zero-padded to the
# next power of two. A plan is the best guess of one layer timed alone; a whole forward shares caches and threads.
ROW_KERNELS = ("planned", "weight_first", "padded")


def kernel_rows(kernel: str, rows: int, planned: int) -> int:
    """The plan entry `kernel` gives for `rows` rows (0: F.linear, m: weight-first over m rows); `planned` is the
    layer's own plan's entry."""
    if kernel == "planned":
        return planned
    if kernel == "weight_first":
        return rows
    if kernel == "padded":
        return 1 << (rows - 1).bit_length()
    raise ValueError(f"unknown row kernel {kernel!r}; known: {ROW_KERNELS}")


def set_row_kernel(model: nn.Module, rows: int, kernel: str) -> None:
    """Let every planned `FewRowLinear` of `model` compute `rows` rows (1..PLANNED_ROWS) by `kernel`."""
    if not 1 <= rows <= PLANNED_ROWS:
        raise ValueError(f"row kernels cover 1..{PLANNED_ROWS} rows, not {rows}")
    for module in model.modules():
        if isinstance(module, FewRowLinear) and module.plan:
            entry = kernel_rows(kernel, rows, row_plan(module.weight)[rows - 1])
            module.plan = (*module.plan[: rows - 1], entry, *module.plan[rows:])


def has_row_plans(model: nn.Module) -> bool:
    return any(isinstance(m, FewRowLinear) and m.plan for m in model.modules())


def worth_swapping(module: nn.Module) -> bool:
    """Measured on x86 CPUs in fp32; other devices and dtypes keep their own kernels."""
    weight = next(module.parameters(), None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32


def use_few_row_linears(model, plans: bool = True) -> int:
    """Replace every `nn.Linear` inside `model` (a module, or a drafter: anything with `.modules()`), in place, by a
    `FewRowLinear` sharing its parameters, with its weight's row plan unless `plans=False` (measured once per shape on
    this machine, then cached); returns how many were replaced. Idempotent."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                parent.register_module(name, FewRowLinear.sharing(child))
                swapped += 1
    if plans:
        for module in model.modules():
            if isinstance(module, FewRowLinear):
                module.plan = row_plan(module.weight)
    return swapped


def linear_kernel(model: nn.Module) -> str:
    """What computes `model`'s linear layers ("few_row" or "nn.Linear"): a cost model is only valid for the same."""
    return "few_row" if any(isinstance(m, FewRowLinear) for m in model.modules()) else "nn.Linear"


def with_stock_linears(model: nn.Module) -> nn.Module:
    """A copy of `model` whose `FewRowLinear`s are `nn.Linear`s again, sharing every parameter and buffer with `model`
    (no weight is copied; `model` is unchanged): transformers as it ships, for a speed baseline."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    stock = copy.deepcopy(model, memo=shared)
    for parent in list(stock.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FewRowLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                parent.register_module(name, linear)
    return stock
