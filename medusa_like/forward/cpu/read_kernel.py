"""How a frozen fp32 model that is read many rows at a time computes its products: training's teacher-forced read of
the target, and a compiled step's prompts.

    check_read_kernel(cfg.target_read_kernel)        # "auto", "onednn" or "linear" (a config check)
    use_read_kernel(target.base_model, "auto")        # whether oneDNN's pack now reads it

Over many rows the products are bound by arithmetic, where oneDNN's packed weight ran faster than `F.linear` on the
CPUs measured (`python -m eval.bench prefill --batch 4 --tokens 384`; docs/training.md): the model's layers become
few-row layers (`few_row_linear.py`) whose products from `from_rows` rows on run on that pack.
"""

import logging

import torch
from torch import nn

from .few_row_linear import MAX_ROWS, PACK_MEMORY_SHARE, onednn_packs_available, packs_fit, use_few_row_linears

log = logging.getLogger(__name__)


READ_KERNELS = ("auto", "onednn", "linear")  # what reads a frozen target's many rows in training


def check_read_kernel(kernel) -> str:
    if kernel not in READ_KERNELS:
        raise ValueError(f"expected one of {list(READ_KERNELS)}, got {kernel!r}")
    return kernel


def use_read_kernel(
    model: nn.Module, kernel: str = "auto", device: torch.device | str | None = None, from_rows: int = MAX_ROWS + 1
) -> bool:
    """Let a frozen model that is read many rows at a time compute every product of `from_rows` rows or more on
    oneDNN's pack (`onednn`; `auto`: where the model is fp32 on a CPU that runs the packs), or keep F.linear
    (`linear`). `from_rows`: over MAX_ROWS by default (training's teacher-forced reads); 2 where the layers read
    prompts alone (a compiled step's prefill: 8-64 tokens took 13-27% less than on nn.Linear, `eval.bench prefill`).
    `device`: where the model will run, if not where its weights are now (a trainer moves it to its accelerator).
    The pack is a second copy of every weight: `auto` keeps F.linear where it would not fit in PACK_MEMORY_SHARE of
    this machine's memory, `onednn` refuses. Only fp32 rounding changes. Returns whether oneDNN now reads it."""
    check_read_kernel(kernel)
    weight = next(model.parameters())
    on_cpu = torch.device(device or weight.device).type == "cpu"
    usable = on_cpu and weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_packs_available()
    fits = usable and packs_fit(model, 1)
    if kernel == "linear" or (kernel == "auto" and not fits):
        if kernel == "auto" and usable:
            log.info("a pack of every weight would not fit in memory: the model's many-row reads keep F.linear")
        return False
    if not usable:
        raise ValueError("read_kernel=onednn needs an fp32 model on a CPU whose torch runs oneDNN's packs")
    if not fits:
        raise ValueError(
            f"read_kernel=onednn lays out a second copy of every weight, which would take more than "
            f"{PACK_MEMORY_SHARE:.0%} of this machine's memory: use read_kernel=linear (or auto, which then keeps it)"
        )
    # fewer rows keep the fp32 kernel where the layers already ran it (a decoding target), else F.linear
    fp32_kernel = any(getattr(m, "fp32_kernel", False) for m in model.modules())
    use_few_row_linears(model, fp32_kernel=fp32_kernel, many_from=from_rows)
    return True
