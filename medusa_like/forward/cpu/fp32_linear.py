"""fp32 products of an eager step's few rows by fused multiply-adds (AVX512 or AVX2), the same bits at any row count.

    reason = fp32_linear.unavailable()          # None where the kernel runs (an AVX2 or AVX512 CPU, the kernel built)
    y = torch.ops.medusa_like.fp32_linear(x, pack(weight), bias, out_features)   # x [..., K] -> [..., N], fp32

BLAS kernels (F.linear, oneDNN's pack) round their sums in an order picked by the row count, so a node of a tree step
can get other bits than in a one-node step (on the default target every node of a 16-node tree did), and a near-tie
can flip.
This kernel (`fp32_linear.cpp`, the fp32 sibling of `bf16_linear.cpp`) computes each output as one fp32 sum over k in
order, whatever the row count or the thread; with the row-invariant attention (`tree_attention.py`), a tree's node
gets the bits of its one-node step, so the eager fp32 step is exact against greedy decoding on it. Each sum is one
fused multiply-add a k, in order, so AVX512 and AVX2 CPUs compute the same bits (`OP_AVX2` runs the AVX2 code on any
CPU, for the tests). Over a weight packed in blocks of 32 outputs it streams the weights at the memory's speed at one
to four rows in either code (docs/cpu-kernels.md). A prompt's products (over `MAX_ROWS` rows) stay on F.linear or
oneDNN: every method prefills the same prompt the same way.
"""

import functools
import logging

import torch
import torch.nn.functional as F

from . import tree_attention
from .extension import Extension, build_in_background

log = logging.getLogger(__name__)

OP = "medusa_like::fp32_linear"  # AVX512 where the CPU has it, else AVX2
OP_AVX2 = "medusa_like::fp32_linear_avx2"  # AVX2 on any CPU: what an AVX2-only CPU computes
BLOCK = 32  # outputs of a packed block (fp32_linear.cpp's kBlockN)


def _shape(x, packed, bias, out_features):
    """The op's output for tracing: x's shape with `out_features` last, fp32, contiguous."""
    return x.new_empty((*x.shape[:-1], out_features))


KERNEL = Extension("fp32_linear", fakes={OP: _shape, OP_AVX2: _shape})


FALLBACK = "the eager fp32 step computes its products on nn.Linear and attends by SDPA"


@functools.cache
def unavailable() -> str | None:
    """None where the kernel runs (loaded once per process), else why not: this CPU has no AVX2, the kernel could
    not be built, or it is not built yet. The eager fp32 step is row-invariant with it and the attention kernel, and
    it is the Python API's default, so a process does not wait for their first builds (seconds each): it starts them
    in the background, keeps nn.Linear and SDPA, and a later process loads both. A failed build is logged once
    per process, with what the step runs instead: a tree row may then round apart from its one-node step."""
    if (why := cpu_unsupported()) is not None:
        log.info("%s: %s", why, FALLBACK)
        return why
    kernels = (KERNEL, tree_attention.KERNEL)
    for kernel in kernels:
        if (failure := kernel.build_failure()) is not None:
            return _fell_back(f"the {kernel.name} kernel could not be built ({failure})")
    if missing := [kernel for kernel in kernels if not kernel.built()]:
        build_in_background(*missing)  # logs that this process runs without them
        return f"the {' and '.join(k.name for k in missing)} kernels are being built here, for later processes"
    why = KERNEL.load()
    return None if why is None else _fell_back(why)


def _fell_back(why: str) -> str:
    log.warning("%s: %s, which may round a tree row apart from its one-node step", why, FALLBACK)
    return why


def operator(qualified: str = OP):
    """The loaded kernel's operator named `qualified` (OP, or OP_AVX2), to call: torch.ops.medusa_like.<name>."""
    namespace, name = qualified.split("::")
    return getattr(getattr(torch.ops, namespace), name)


def cpu_unsupported() -> str | None:
    """Why this CPU cannot run the kernel (no AVX2 fused multiply-add, by torch's reckoning), or None."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "this CPU has no AVX2 fused multiply-add"  # ATen's AVX2 level includes FMA
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 32), K, 32]: blocks of 32 outputs (zero-padded), each k's 32 weights together."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % BLOCK))  # [N', K]
    return padded.reshape(-1, BLOCK, k).permute(0, 2, 1).contiguous()
