"""A row-invariant attention for the compiled step on CPUs: a tree row gets the very bits its one-node step gets.

    reason = tree_attention.unavailable()      # None once the kernel is built and loaded (once per machine and torch)
    out = torch.ops.medusa_like.tree_attention(query, key, value, visible, scale)   # [1, H, T, D]

Greedy decoding on the compiled step computes each token in a one-node step; a tree step computes the same token as
one row of many. The compiled products give a row the same bits either way, but `scaled_dot_product_attention` sums a
row's keys in an order that depends on the rows beside it, on the key count and on where the masked keys sit. In
fp32 the difference is a few units of the last place, and no greedy token measured has flipped; in bf16 every
activation is rounded, the differences grow into flipped near-ties, and a bf16 target was not lossless
(docs/cpu-kernels.md). This kernel (`tree_attention.cpp`) computes each row alone: its visible keys in slot order
(which is position order, in a one-node step as in a tree), each score a fixed sequence of float operations over the
head's dimensions, a softmax in fp32, the weighted values summed key after key into two running sums that alternate
by the key's rank among those the row sees. Nothing it does for a row depends on the other rows or on the masked
keys, so a node's output is the same in any tree, and a step is exact against greedy decoding on the same step, in
bf16 as in fp32.

Contract (as `scaled_dot_product_attention` with a boolean mask and grouped-query heads): query [1, H, T, D], key and
value [1, H_kv, S, D], visible [1, 1, T, S] bool (every row sees at least one key), float32 or bfloat16 alike, D up to
128 (or 241-256) -> [1, H, T, D] contiguous, in the query's dtype. Scores, weights and sums are fp32.

It is built on first use with torch's C++ extension builder (a few seconds), into the user cache, keyed by its source,
the compiler flags, torch's version and the machine; a later process loads the built library. Where it cannot be
built (no compiler, no ninja), `unavailable()` says why and the step attends by SDPA, as before.
"""

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from medusa_like.io import user_cache_dir

from .machine import machine_identity

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
# -ffp-contract=off: a multiply and an add stay two roundings in wide and narrow registers alike (no fused
# multiply-add in one and not the other), so the same source gives the same bits however the compiler vectorizes it
# -fopenmp: ATen's parallel_for splits the rows over torch's threads (without it, it runs them on one)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
OP = "medusa_like::tree_attention"
# torch's builder waits for the lock file of a build in progress for as long as it exists, and a build killed midway
# leaves it behind: one older than this (a build takes seconds) is a dead build's, and is removed
STALE_LOCK_SECONDS = 600


def build_key() -> str:
    """What a build depends on: the kernel's source, the flags, torch's version and the machine (digest)."""
    text = "\n".join([SOURCE.read_text(encoding="utf-8"), *FLAGS, torch.__version__, machine_identity()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def unavailable() -> str | None:
    """Build (or reuse) and load the kernel once per process: None when `torch.ops.medusa_like.tree_attention` runs,
    else why it cannot here (the caller attends by SDPA)."""
    from torch.utils import cpp_extension

    directory = user_cache_dir() / "kernels" / f"tree_attention-{build_key()}"
    try:
        _find_ninja()
        directory.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(directory)
        # the builder takes a lock in `directory`: two processes building at once build it once
        cpp_extension.load(
            name="medusa_like_tree_attention",
            sources=[str(SOURCE)],
            extra_cflags=list(FLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
        )
    except Exception as err:  # no compiler, no ninja, a failed build: each raises its own type
        text = str(err).strip().splitlines()
        why = f"the tree attention kernel could not be built ({type(err).__name__}: {text[-1] if text else ''})"
        log.warning("%s: the compiled step attends by SDPA, whose tree rows may round apart from one-node steps", why)
        return why
    torch.library.register_fake(OP)(_shape)
    return None


def clear_stale_lock(directory: Path) -> bool:
    """Remove the build lock in `directory` if a killed build left it (older than `STALE_LOCK_SECONDS`), with a log
    line; whether it did."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_SECONDS:
        return False
    log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _find_ninja() -> None:
    """Put the `ninja` package's binary on PATH where no other is (torch's builder runs `ninja` by name, and a
    virtual environment's scripts are on PATH only when it is activated)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # the builder's own error says what is missing
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _shape(query, key, value, visible, scale):
    """The op's output for tracing: the query's shape and dtype, contiguous."""
    return query.new_empty(query.shape)


def supports(query: torch.Tensor, softcap) -> bool:
    """Whether this attention runs the kernel: a CPU query of a supported dtype and head size, no logit soft-capping,
    and the kernel loaded."""
    dim = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and (dim <= 128 or 241 <= dim <= 256)
        and not softcap
        and unavailable() is None
    )
