"""Linear layers on this CPU's kernels: a decoding step's few rows with the same bits at any row count, a prompt's
many on oneDNN's packed weight.

A tree step multiplies a handful of rows (the verified nodes, a drafter's top-k) by every weight of the model. BLAS
picks its blocking from the row count, so `nn.Linear` rounds a tree row otherwise than the same row alone, and a
near-tie between a tree node and greedy decoding's one-node step can flip. `FewRowLinear` (same parameters, swapped
in place) computes, on a CPU:

| weight | 1..MAX_ROWS rows | more rows (a prompt, training's read) |
|---|---|---|
| fp32, AVX2 or AVX512 | this project's fp32 kernel over its pack (`fp32_linear.py`) | oneDNN's pack, else F.linear |
| fp32 drafter (`fp32_kernel=False`) | `weight @ x.T`, one row padded to two (`weight_first_linear`) | the same |
| bf16, AVX512-BF16 | this project's dot-product kernel over its pack (`bf16_linear.py`) | the same |
| bf16, AMX without AVX512-BF16 | oneDNN's pack | the same |

Both kernels give a row the same bits at any row count (with the row-invariant attention of `tree_attention.py`, a
tree's node gets its one-node step's bits). A drafter's rows need no such bits (the target verifies every draft), and
its small weights sit in the caches, where MKL computes a few rows about twice as fast with the weight as the left
operand as either kernel or `F.linear` (`python -m eval.bench draft --drafter-dtype float32`; docs/cpu-kernels.md). From `many_from` rows on, oneDNN's pack computes fp32 products: over
MAX_ROWS by default, from 2 where the layers only read prompts (a compiled step's, `read_kernel.py`). Elsewhere
(other devices and dtypes, CPUs without the kernels, packs that do not fit in memory) layers keep `nn.Linear`
(`worth_swapping`). A pack is a copy of the weight laid out once, made again when the weight changes; derived data,
not in the state dict.
"""

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from . import bf16_linear, fp32_linear
from .layer_swap import copy_replacing

MAX_ROWS = 64  # a decoding step's rows at most (a tree's nodes, a drafter's); more are a prompt's
PACK_MEMORY_SHARE = 0.25  # the packs of a model's weights may take at most this share of the machine's memory
LINEARS = ("few_row", "nn.Linear")  # what computes a model's linear layers (`linear_kernel`: a cost model's record)

# the operators the layers' products run, as torch's profiler names them (what a benchmark counts as products)
PROFILED_PRODUCTS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")
ONEDNN = "onednn"  # the key of oneDNN's pack: one layout for every row count
DOT = "dot"  # the key of a bf16 pack for the dot-product kernel (`bf16_linear.pack`)
FP32_DOT = "dot32"  # the key of an fp32 pack for the fp32 kernel (`fp32_linear.pack`)


def weight_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as `(weight @ x.T).T`, one row zero-padded to two: x [..., in] -> [..., out]."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, in], in memory order: MKL multiplies transposed rows more slowly
    rows = flat.shape[0]
    y = (weight @ (F.pad(flat, (0, 0, 0, 1)) if rows == 1 else flat).T).T[:rows]  # [rows, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class KernelRecordError(ValueError):
    """A cost model's kernel record that is not one: the message names the field and its value."""


class KernelMismatchError(ValueError):
    """A cost model measured on other layers than the target's."""


def weight_stamp(weight: torch.Tensor) -> tuple:
    """What changes when a weight does (in place, or replaced): what a pack is checked against. Inference tensors
    keep no version counter: their address alone."""
    return (None if weight.is_inference() else weight._version, weight.data_ptr())


def onednn_packs_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_bf16_packs_available() -> bool:
    """Where bf16 products run natively on oneDNN's pack: CPUs with AMX or AVX512-BF16 (elsewhere bf16 is emulated
    and layers keep `nn.Linear`)."""
    native = (
        getattr(torch.cpu, name, lambda: False)() for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    )
    return onednn_packs_available() and any(native)


def bf16_pack(weight: torch.Tensor) -> str | None:
    """The pack every product of a bf16 CPU weight runs on: the dot-product kernel's (DOT) where it runs, else
    oneDNN's where bf16 is native; None for other weights."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    if bf16_linear.unavailable() is None:
        return DOT
    return ONEDNN if onednn_bf16_packs_available() else None


class WeightPacks:
    """A weight's packs by key (DOT, FP32_DOT, ONEDNN), made on first use and again if the weight changed. Not
    copied with the layer."""

    def __init__(self):
        self.packs: dict[str, tuple[tuple, torch.Tensor]] = {}  # key -> ((weight version, address), pack)

    def get(self, weight: torch.Tensor, key: str) -> torch.Tensor:
        stamp = weight_stamp(weight)
        found = self.packs.get(key)
        if found is None or found[0] != stamp:
            layout = {DOT: bf16_linear.pack, FP32_DOT: fp32_linear.pack}.get(
                key, torch.ops.mkldnn._reorder_linear_weight
            )
            with torch.no_grad():
                found = self.packs[key] = (stamp, layout(weight.detach()))
        return found[1]

    def __len__(self) -> int:
        return len(self.packs)

    def __deepcopy__(self, memo) -> "WeightPacks":
        return WeightPacks()


class FewRowLinear(nn.Linear):
    """`nn.Linear` (same parameters) on this CPU's kernels (the module docstring's table)."""

    fp32_kernel: bool = False  # fp32: 1..MAX_ROWS rows by the fp32 kernel (else weight-first)
    many_from: int | None = None  # fp32: from this many rows on, oneDNN's pack (None: F.linear)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packs = WeightPacks()

    @classmethod
    def sharing(cls, linear: nn.Linear) -> "FewRowLinear":
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        weight = self.weight
        if weight.device.type != "cpu":  # moved to another device (a trainer's GPU)
            return F.linear(x, weight, self.bias)
        if weight.dtype == torch.bfloat16:
            shared = bf16_pack(weight)
            if shared == DOT:
                return torch.ops.medusa_like.bf16_linear(x, self.packs.get(weight, DOT), self.bias, self.out_features)
            return self._onednn(x) if shared == ONEDNN else F.linear(x, weight, self.bias)
        rows = x.numel() // x.shape[-1]
        if weight.dtype == torch.float32 and self.many_from is not None and rows >= self.many_from:
            return self._onednn(x)
        if weight.dtype == torch.float32 and rows <= MAX_ROWS:
            if self.fp32_kernel:
                pack = self.packs.get(weight, FP32_DOT)
                return torch.ops.medusa_like.fp32_linear(x, pack, self.bias, self.out_features)
            return weight_first_linear(x.contiguous(), weight, self.bias)
        return F.linear(x, weight, self.bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        pack = self.packs.get(self.weight, ONEDNN)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), pack, self.bias, "none", [], "")

    def wanted_packs(self) -> set[str]:
        """The packs this layer's products run on."""
        shared = bf16_pack(self.weight)
        if shared is not None:
            return {shared}
        if self.weight.dtype != torch.float32 or self.weight.device.type != "cpu":  # other dtypes: F.linear
            return set()
        return {*([FP32_DOT] if self.fp32_kernel else []), *([ONEDNN] if self.many_from else [])}


def packs_fit(model: nn.Module, copies: int) -> bool:
    """Whether `copies` packed copies of every linear weight of `model` fit in PACK_MEMORY_SHARE of this machine's
    memory."""
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return weights * copies <= PACK_MEMORY_SHARE * memory


def fp32_copies() -> int:
    """The packs an fp32 layer keeps: the fp32 kernel's, and oneDNN's where it runs."""
    return 1 + int(onednn_packs_available())


def worth_swapping(module: nn.Module) -> bool:
    """Whether `module`'s layers compute on a kernel of this CPU's (the module docstring's table): fp32 where the fp32
    kernel runs, bf16 where a bf16 pack does, their packs fitting in memory; else they keep `nn.Linear`."""
    weight = next(module.parameters(), None)
    if weight is None or weight.device.type != "cpu":
        return False
    if weight.dtype == torch.float32:  # memory first: where the packs do not fit, the kernel is not built
        return packs_fit(module, fp32_copies()) and fp32_linear.unavailable() is None
    return bf16_pack(weight) is not None and packs_fit(module, 1)


def use_few_row_linears(model, fp32_kernel: bool = True, many_from: int | None = MAX_ROWS + 1) -> int:
    """Replace every `nn.Linear` inside `model` (a module, or a drafter: anything with `.modules()`), in place, by a
    `FewRowLinear` sharing its parameters; returns how many were replaced. fp32 layers run the fp32 kernel for a
    step's rows (`fp32_kernel`, where it runs: a target's; else weight-first: a drafter's) and oneDNN's pack from
    `many_from` rows on (where it runs; None:
    F.linear). Idempotent; the packs are made now, not in the first timed step."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                parent.register_module(name, FewRowLinear.sharing(child))
                swapped += 1
    kernel = fp32_kernel and fp32_linear.unavailable() is None
    onednn = many_from if onednn_packs_available() else None
    for module in model.modules():
        if isinstance(module, FewRowLinear):
            module.fp32_kernel, module.many_from = kernel, onednn
            for key in module.wanted_packs():
                module.packs.get(module.weight, key)
    return swapped


def linear_kernel(model: nn.Module) -> str:
    """What computes `model`'s linear layers (one of LINEARS): a cost model is only valid for the same."""
    return "few_row" if any(isinstance(m, FewRowLinear) for m in model.modules()) else "nn.Linear"


def kernel_record(model: nn.Module) -> dict:
    """What a cost model of `model`'s step records of its kernels."""
    return {"linears": linear_kernel(model)}


def validate_record(record) -> None:
    """Refuse a malformed record (`KernelRecordError`); None (nothing recorded) passes."""
    if record is not None and (
        not isinstance(record, dict) or set(record) != {"linears"} or record["linears"] not in LINEARS
    ):
        raise KernelRecordError(
            f"kernels must be {{'linears': one of {list(LINEARS)}}}, got {record!r} (a record of another version of "
            "this project: measure the cost model again)"
        )


def check_kernels(record, model: nn.Module) -> None:
    """Refuse a malformed record (`KernelRecordError`) or one of other layers than `model`'s (`KernelMismatchError`);
    None (nothing recorded) passes."""
    validate_record(record)
    if record is not None and record["linears"] != linear_kernel(model):
        raise KernelMismatchError(
            f"measured with linears {record['linears']!r}, but this target's are {linear_kernel(model)!r}"
        )


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
