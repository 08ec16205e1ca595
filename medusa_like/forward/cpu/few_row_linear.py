"""Linear layers for the few rows of a decoding step on a CPU.

A tree step multiplies a handful of rows (the verified nodes, or a drafter's top-k) by every weight of the model. x86
BLAS (MKL, as torch ships it) often does this faster when the weight is the left operand, `W @ x.T`, than in
`nn.Linear`'s orientation, `x @ W.T`, and for some row counts faster still over a few zero rows more. Each
`FewRowLinear` carries its weight's row plan (`row_plans.py`, measured once per shape on this machine): for
1..MAX_ROWS rows, `F.linear` or weight-first over how many rows. Until its plan is measured a layer runs `F.linear`
for one row and weight-first for 2..MAX_ROWS (`UNMEASURED_PLAN`). Longer products (a prompt's prefill) run
`F.linear`, or oneDNN's pack (below). `python -m eval.bench linear` measures the whole forward.

From a few rows on, MKL's packed sgemm can do better still: the weight is laid out once for a product over m rows
(`torch.ops.mkl._mkl_reorder_linear_weight`, what inductor uses for frozen CPU linears), and the product over m rows
runs on that layout. A pack holds for one row count only and is a copy of the weight, so a layer keeps packs for a few
row counts (PACK_ROWS; fewer rows are zero-padded); the cost model's measurement picks this kernel per tree size where
whole forwards run faster with it (`kernel_choice.py`), and makes the packs its picks run (`sync_packs`), dropping the
others.

oneDNN lays a weight out once for every row count (`torch.ops.mkldnn._reorder_linear_weight`, what inductor uses
for frozen bf16 CPU linears) and runs its own JIT kernels for the CPU's instruction set, whoever made the CPU; MKL
takes slower paths on some vendors' CPUs. So oneDNN's pack is a row kernel too (plan entry ONEDNN), picked per tree
size the same way, and a prompt's products over MAX_ROWS rows run on it where the measurement found that faster than
F.linear (`FewRowLinear.prefill`; `python -m eval.bench prefill`). bf16 layers carry no row plans: on a CPU with
AVX512-BF16 every bf16 product runs this project's dot-product kernel over its pack (`bf16_linear.py`), which gives a
row the same bits at any row count, so that tree steps round as one-node steps do (oneDNN's bf16 pack did not: a
row of a 4-row down projection came out otherwise than alone); on one with AMX alone, oneDNN's pack (`F.linear` in
bf16 reorders the weight at every call).

fp32 layers of a decoding target (`row_invariant=True`) on a CPU where torch runs AVX2 or AVX512 carry no row plans
either: every product of 1..MAX_ROWS rows runs this project's fp32 kernel over a pack they keep (`fp32_linear.py`,
`row_invariant_fp32`), which gives a row the same bits at any row count, and a prompt's rows oneDNN's pack; the
plans, MKL's packs and the kernel choice per tree size are what other fp32 layers run (drafters, training's read),
and what a target's run elsewhere (and where the packs do not fit in memory).

The swap shares the original parameters (no copy, same state-dict keys) and changes only rounding (fp32 or bf16), as
any other row count or kernel would: the target's greedy decoding stays the reference, computed with the same layers.
"""

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from . import bf16_linear, fp32_linear
from .layer_swap import copy_replacing
from .row_plans import PLANNED_ROWS, cached_row_plan, row_plan

MAX_ROWS = PLANNED_ROWS  # above this (64) a product is a prefill: F.linear, or oneDNN's pack (`prefill`)
PACK_ROWS = (4, 8, 16, 32)  # the row counts MKL packs are made for; a plan entry -m runs a pack for m rows
ONEDNN = -1  # the plan entry that runs oneDNN's pack, one layout for every row count (no MKL pack is made for 1 row)
KERNEL_ROWS = PACK_ROWS[-1]  # the tree sizes a row kernel is picked for in whole forwards (`kernel_choice.py`)
PACK_MEMORY_SHARE = 0.25  # packs for every PACK_ROWS of a model may take at most this share of the machine's memory


def weight_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(weight @ x.T).T`: x [..., in], weight [out, in] -> [..., out]."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    y = (weight @ flat.T).T  # [rows, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def weight_stamp(weight: torch.Tensor) -> tuple:
    """What changes when a weight does (in place, or replaced): what data derived from it (packs, copies) is checked
    against. Inference tensors keep no version counter: their address alone."""
    return (None if weight.is_inference() else weight._version, weight.data_ptr())


def mkl_packs_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_packs_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_bf16_packs_available() -> bool:
    """Where bf16 layers run on oneDNN's packed weight: CPUs that compute in bf16, with AMX or AVX512-BF16, where whole
    forwards ran faster on it (`python -m eval.bench linear --dtype bfloat16`). Elsewhere (AVX2, AVX512 without BF16: bf16
    emulated) bf16 layers keep `nn.Linear`'s own kernel."""
    native = (
        getattr(torch.cpu, name, lambda: False)() for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    )
    return onednn_packs_available() and any(native)


# the operators `few_row_product`'s kernels run, as torch's profiler names them (what a benchmark counts as products)
PROFILED_PRODUCTS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "mkl::_mkl_linear")
ANY_ROWS = 0  # the key of a oneDNN pack: one layout serves every row count
DOT = "dot"  # the key of a bf16 pack for the dot-product kernel (`bf16_linear.pack`): every row count too
FP32_DOT = "dot32"  # the key of an fp32 pack for the fp32 kernel (`fp32_linear.pack`): every few-row count
# what a layer runs until its weight's plan is measured: F.linear for one row, weight-first over 2..MAX_ROWS rows
UNMEASURED_PLAN = (0, *range(2, PLANNED_ROWS + 1))


def bf16_pack(weight: torch.Tensor) -> int | str | None:
    """The pack every product of a layer of this weight runs on, whatever its plan: for bf16 on a CPU, the
    dot-product kernel's (DOT) where it runs, else oneDNN's (ANY_ROWS) where those run; None for other weights."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    if bf16_linear.unavailable() is None:
        return DOT
    return ANY_ROWS if onednn_bf16_packs_available() else None


class WeightPacks:
    """A weight laid out for a packed product: MKL's sgemm, one pack per row count (fp32), or oneDNN's, one pack for
    any row count (fp32 or bf16, key ANY_ROWS). Made on first use, made again if the weight changed. Derived data: not
    in the state dict, and not copied with the layer."""

    def __init__(self):
        self.packs: dict[int | str, tuple[tuple, torch.Tensor]] = {}  # rows -> ((weight version, address), pack)

    def get(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        stamp = weight_stamp(weight)
        found = self.packs.get(rows)
        if found is None or found[0] != stamp:
            with torch.no_grad():
                if rows == DOT:
                    pack = bf16_linear.pack(weight.detach())
                elif rows == FP32_DOT:
                    pack = fp32_linear.pack(weight.detach())
                elif rows == ANY_ROWS:
                    pack = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
                else:
                    pack = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
            found = (stamp, pack)
            self.packs[rows] = found
        return found[1]

    def keep(self, rows: set[int | str]) -> None:
        self.packs = {m: pack for m, pack in self.packs.items() if m in rows}

    def __len__(self) -> int:
        return len(self.packs)

    def __deepcopy__(self, memo) -> "WeightPacks":
        return WeightPacks()


def onednn_product(x: torch.Tensor, packs: WeightPacks, weight: torch.Tensor, bias: torch.Tensor | None):
    """`F.linear(x, weight, bias)` on oneDNN's pack of `weight`: x [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packs.get(weight, ANY_ROWS), bias, "none", [], "")


def few_row_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: tuple[int, ...] = (),
    packs: WeightPacks | None = None,
    prefill: int = 0,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the kernel `plan` names for x's row count (`row_plans.py`): 0 -> F.linear,
    m -> weight-first over the rows padded with zero rows to m, -m -> MKL's packed sgemm over them padded to m,
    ONEDNN -> oneDNN's packed product (both need `packs`). Row counts the plan does not cover: weight-first for
    2..MAX_ROWS; over MAX_ROWS (a prefill) the entry `prefill`, 0 or ONEDNN. bf16 with `packs`: the kernel of
    `bf16_pack` for any row count, whatever the plan."""
    if weight.device.type != "cpu":  # CPU kernels: a layer moved to another device (a trainer's GPU) runs F.linear
        return F.linear(x, weight, bias)
    shared = bf16_pack(weight) if packs is not None else None
    if shared == DOT:
        return torch.ops.medusa_like.bf16_linear(x, packs.get(weight, DOT), bias, weight.shape[0])
    if shared == ANY_ROWS:
        return onednn_product(x, packs, weight, bias)
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS:
        return onednn_product(x, packs, weight, bias) if prefill == ONEDNN else F.linear(x, weight, bias)
    # Rows in memory order, as the plan was timed: a weight-first product leaves its output transposed ([rows, out]
    # with strides (1, rows)), and MKL multiplies the next weight by such rows markedly more slowly.
    x = x.contiguous()
    entry = plan[rows - 1] if 0 < rows <= len(plan) else (rows if rows >= 2 else 0)
    if entry == ONEDNN:
        return onednn_product(x, packs, weight, bias)
    if entry == 0:
        return F.linear(x, weight, bias)
    if entry == rows:
        return weight_first_linear(x, weight, bias)
    padded = abs(entry)
    flat = F.pad(x.reshape(rows, -1), (0, 0, 0, padded - rows))  # [m, in]: zero rows after x's
    if entry > 0:
        y = weight_first_linear(flat, weight, bias)  # [m, out]
    else:
        y = torch.ops.mkl._mkl_linear(flat, packs.get(weight, padded), weight, bias, padded)  # [m, out]
    return y[:rows].reshape(*x.shape[:-1], weight.shape[0])


class FewRowLinear(nn.Linear):
    """`nn.Linear` (same parameters) that computes few rows by its weight's row plan (`few_row_product`), and a
    prefill's many by F.linear or oneDNN (`prefill`: 0 or ONEDNN, picked by the cost model's measurement)."""

    plan: tuple[int, ...] = ()
    plan_measured: bool = False  # whether `plan` derives from its weight's measured plan (else UNMEASURED_PLAN's)
    prefill: int = 0
    # fp32: every product of 1..MAX_ROWS rows by the fp32 kernel, whatever the plan (it has none): `use_few_row_linears`
    row_invariant: bool = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packs = WeightPacks()  # the weight laid out for the row counts the plan runs packed, or for bf16

    @classmethod
    def sharing(cls, linear: nn.Linear) -> "FewRowLinear":
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.row_invariant and weight.dtype == torch.float32 and weight.device.type == "cpu":
            if x.numel() <= MAX_ROWS * x.shape[-1]:
                pack = self.packs.get(weight, FP32_DOT)
                return torch.ops.medusa_like.fp32_linear(x, pack, self.bias, self.out_features)
        return few_row_product(x, weight, self.bias, self.plan, self.packs, self.prefill)


# What computes n rows in every layer at once, chosen per row count by timing whole forwards (`kernel_choice.py`):
# `F.linear` (transformers' own product), each layer's own plan (timed one layer at a time), weight-first over the n
# rows, or over n rows zero-padded to the next power of two, MKL's packed sgemm over the rows padded to the next of
# PACK_ROWS, or oneDNN's pack. A plan is the best guess of one layer timed alone; a whole forward shares caches and
# threads.
ROW_KERNELS = ("linear", "planned", "weight_first", "padded", "packed", "onednn")
PREFILL_KERNELS = ("linear", "onednn")  # what computes a prefill's rows (over MAX_ROWS) in every layer


def kernel_rows(kernel: str, rows: int, planned: int) -> int:
    """The plan entry `kernel` gives for `rows` rows (0: F.linear, m: weight-first over m rows, -m: MKL-packed over m
    rows, ONEDNN); `planned` is the layer's own plan's entry."""
    if kernel == "linear":
        return 0
    if kernel == "planned":
        return planned
    if kernel == "weight_first":
        return rows
    if kernel == "padded":
        return 1 << (rows - 1).bit_length()
    if kernel == "packed":
        if rows > KERNEL_ROWS:
            raise ValueError(f"MKL packs serve 1..{KERNEL_ROWS} rows, not {rows}")
        return -next(m for m in PACK_ROWS if m >= rows)
    if kernel == "onednn":
        return ONEDNN
    raise ValueError(f"unknown row kernel {kernel!r}; known: {ROW_KERNELS}")


def packs_fit(model: nn.Module, copies: int) -> bool:
    """Whether `copies` packed copies of every linear weight of `model` fit in PACK_MEMORY_SHARE of this machine's
    memory."""
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return weights * copies <= PACK_MEMORY_SHARE * memory


def usable_row_kernels(model: nn.Module) -> tuple[str, ...]:
    """The row kernels this machine can run for `model`: "onednn" needs oneDNN and a pack of every weight in memory,
    "packed" needs MKL and, besides that, packs for every PACK_ROWS in memory."""
    onednn = onednn_packs_available() and packs_fit(model, 1)
    packed = mkl_packs_available() and packs_fit(model, len(PACK_ROWS) + int(onednn))
    usable = {"onednn": onednn, "packed": packed}  # the other kernels run everywhere
    return tuple(k for k in ROW_KERNELS if usable.get(k, True))


def wanted_packs(module: FewRowLinear) -> set[int | str]:
    """The packs a layer runs: for bf16 its `bf16_pack`; else its oneDNN pack (key ANY_ROWS) where its plan or prefill
    names ONEDNN, and an MKL pack for each row count -m its plan names."""
    shared = bf16_pack(module.weight)
    if shared is not None:
        return {shared}
    if module.row_invariant:
        return {FP32_DOT, *([ANY_ROWS] if module.prefill == ONEDNN else [])}
    entries = (*module.plan, module.prefill)
    return {ANY_ROWS if entry == ONEDNN else -entry for entry in entries if entry < 0}


def sync_packs(model: nn.Module) -> None:
    """Give every layer the packs it runs (`wanted_packs`), and only those: unused ones are dropped, missing ones made
    now (else the first step that needs one would pay for laying out every weight)."""
    for module in model.modules():
        if isinstance(module, FewRowLinear):
            wanted = wanted_packs(module)
            module.packs.keep(wanted)
            for rows in wanted:
                module.packs.get(module.weight, rows)


def set_row_kernel(model: nn.Module, rows: int, kernel: str) -> None:
    """Let every planned `FewRowLinear` of `model` compute `rows` rows (1..KERNEL_ROWS) by `kernel`."""
    if not 1 <= rows <= KERNEL_ROWS:
        raise ValueError(f"row kernels cover 1..{KERNEL_ROWS} rows, not {rows}")
    for module in model.modules():
        if isinstance(module, FewRowLinear) and module.plan:
            entry = kernel_rows(kernel, rows, row_plan(module.weight)[rows - 1])
            module.plan = (*module.plan[: rows - 1], entry, *module.plan[rows:])


def set_prefill_kernel(model: nn.Module, kernel: str) -> None:
    """Let every planned `FewRowLinear` of `model` compute products over MAX_ROWS rows by `kernel`."""
    if kernel not in PREFILL_KERNELS:
        raise ValueError(f"unknown prefill kernel {kernel!r}; known: {PREFILL_KERNELS}")
    for module in model.modules():
        if isinstance(module, FewRowLinear) and module.plan:
            module.prefill = ONEDNN if kernel == "onednn" else 0


def has_row_plans(model: nn.Module) -> bool:
    return any(isinstance(m, FewRowLinear) and m.plan for m in model.modules())


def worth_swapping(module: nn.Module) -> bool:
    """Measured on x86 CPUs: fp32, and bf16 where a bf16 pack runs (`bf16_pack`) and one of every weight fits in
    memory; other devices and dtypes keep their own kernels."""
    weight = next(module.parameters(), None)
    if weight is None or weight.device.type != "cpu":
        return False
    return weight.dtype == torch.float32 or (bf16_pack(weight) is not None and packs_fit(module, 1))


def use_few_row_linears(model, plans: bool | str = True, row_invariant: bool = False) -> int:
    """Replace every `nn.Linear` inside `model` (a module, or a drafter: anything with `.modules()`), in place, by a
    `FewRowLinear` sharing its parameters; returns how many were replaced. fp32 layers get their weight's row plan:
    `plans=True` measures the missing ones (`row_plans.row_plan`), "cached" takes those this machine's cache holds and
    gives the others UNMEASURED_PLAN until `measure_row_plans` (nothing is measured: what a model's construction uses),
    False none. bf16 layers get their bf16 pack now instead (`bf16_pack`), where one runs, and with `row_invariant`
    (a target whose eager step decodes: a tree row must get its one-node step's bits) fp32 layers the fp32 kernel's
    where it runs (`row_invariant_fp32`: no plan, oneDNN for prompts). Idempotent: a layer keeps a measured plan, and
    the kernels set in it, when called again."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                parent.register_module(name, FewRowLinear.sharing(child))
                swapped += 1
    fp32 = [m for m in model.modules() if isinstance(m, FewRowLinear) and m.weight.dtype == torch.float32]
    invariant = bool(fp32) and row_invariant and row_invariant_fp32(model)
    for module in fp32:
        if invariant:  # no plan: the fp32 kernel for every step, oneDNN (where it runs) for a prompt's rows
            module.row_invariant, module.plan, module.plan_measured = True, (), False
            module.prefill = ONEDNN if onednn_packs_available() else 0
        elif module.row_invariant:  # back to row plans (given below), prompts on F.linear until a kernel is set
            module.row_invariant, module.prefill = False, 0
    if plans:
        layers = [
            m
            for m in model.modules()
            if isinstance(m, FewRowLinear) and bf16_pack(m.weight) is None and not m.row_invariant
        ]
        _give_plans(layers, measure=plans is True)
    sync_packs(model)  # bf16 packs made now, not in the first timed step
    return swapped


def _give_plans(layers: list[FewRowLinear], measure: bool) -> None:
    """Each layer without a measured plan gets its weight's (measured now if `measure`, else only if cached), else
    UNMEASURED_PLAN if it has none."""
    for module in layers:
        if not module.plan_measured:
            plan = row_plan(module.weight) if measure else cached_row_plan(module.weight)
            if plan is not None:
                module.plan, module.plan_measured = plan, True
            elif not module.plan:
                module.plan = UNMEASURED_PLAN


def measure_row_plans(model: nn.Module) -> None:
    """Give every planned layer of `model` whose plan was not measured yet its weight's measured plan (measured now
    where the cache has none): what the row kernel "planned" names."""
    _give_plans([m for m in model.modules() if isinstance(m, FewRowLinear) and m.plan], measure=True)


def row_invariant_fp32(model: nn.Module) -> bool:
    """Whether `model`'s fp32 few-row layers compute every step's products by the fp32 kernel (`fp32_linear.py`): where
    it runs and its pack of every weight, with oneDNN's for prompts, fits in memory. Elsewhere they keep row plans."""
    # memory first: where the packs do not fit, the kernel is not asked for (nor built in the background)
    return packs_fit(model, 1 + int(onednn_packs_available())) and fp32_linear.unavailable() is None


def linear_kernel(model: nn.Module) -> str:
    """What computes `model`'s linear layers ("few_row", "few_row_fp32_kernel" or "nn.Linear"): a cost model is only
    valid for the same."""
    layers = [m for m in model.modules() if isinstance(m, FewRowLinear)]
    if not layers:
        return "nn.Linear"
    return "few_row_fp32_kernel" if any(m.row_invariant for m in layers) else "few_row"


def with_stock_linears(model: nn.Module) -> nn.Module:
    """A copy of `model` whose `FewRowLinear`s are `nn.Linear`s again, sharing every parameter and buffer with `model`
    (no weight is copied; `model` is unchanged): transformers as it ships, for a speed baseline."""

    def stock(child):
        if isinstance(child, FewRowLinear):
            linear = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
            linear.weight, linear.bias = child.weight, child.bias
            return linear
        return None

    return copy_replacing(model, stock)
