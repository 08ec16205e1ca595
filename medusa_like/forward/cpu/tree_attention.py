"""A row-invariant attention for the compiled step on CPUs: a tree row gets the very bits its one-node step gets.

    reason = tree_attention.unavailable()      # None once the kernel is built and loaded (once per machine and torch)
    out = torch.ops.medusa_like.tree_attention(query, key, value, visible, scale)   # [B, H, T, D]

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

Contract (as `scaled_dot_product_attention` with a boolean mask and grouped-query heads): query [B, H, T, D], key and
value [B, H_kv, S, D], visible [B, 1, T, S] bool (every row sees at least one key), float32 or bfloat16 alike, D up to
128 (or 241-256) -> [B, H, T, D] contiguous, in the query's dtype. Scores, weights and sums are fp32. Each sequence b
of a batch is computed as it would be alone (its own keys and mask), so a batch's row gets the bits of its batch-1
step.

It is built on first use with torch's C++ extension builder (a few seconds), into the user cache, keyed by its source,
the compiler flags, torch's version and the machine; a later process loads the built library. Where it cannot be
built (no compiler, no ninja), `unavailable()` says why and the step attends by SDPA, as before.

The eager step of a bf16 target, and of an fp32 one on the fp32 kernel, attends through it too (`rows_attention`, the
attention backend `rows`: `decoding/attention.py`'s contract), for the same reason: with SDPA a tree row can round
apart from its one-node step and flip a near-tie (`tests/test_tree_attention.py` shows one on fp32 SDPA).
"""

import functools
import logging

import torch

from medusa_like.decoding import attention

from .extension import Extension

log = logging.getLogger(__name__)

OP = "medusa_like::tree_attention"


def _shape(query, key, value, visible, scale):
    """The op's output for tracing: the query's shape and dtype, contiguous."""
    return query.new_empty(query.shape)


KERNEL = Extension("tree_attention", fakes={OP: _shape})


@functools.cache
def unavailable() -> str | None:
    """Build (or reuse) and load the kernel once per process: None when `torch.ops.medusa_like.tree_attention` runs,
    else why it cannot here (the caller attends by SDPA)."""
    why = KERNEL.load()
    if why:
        log.warning(
            "%s: the compiled step (and an eager bf16 one) attends by SDPA, whose tree rows may round apart from "
            "one-node steps",
            why,
        )
    return why


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


BACKEND = "rows"  # the eager step's attention backend over this kernel


def rows_attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, **kw):
    """The eager step's attention backend `rows` (`decoding/attention.py`'s contract: a [1, 1, T, T] tree mask, or
    None for a causal block, over the live cache; or a batch's [B, 1, T, S] mask): a step's rows attend by the
    kernel, each alone; a whole sequence (a prompt's prefill, as in the compiled step) and what the kernel does not
    take (`supports`) by SDPA."""
    rows, keys = query.shape[2], key.shape[2]
    if rows == keys or not supports(query, softcap):
        return attention.sdpa_tree_attention(
            module, query, key, value, attention_mask, scaling, sliding_window, softcap
        )
    visible = attention.visible_to(attention_mask, rows, keys, sliding_window)  # [T, S] or [B, 1, T, S]
    visible = visible.to(query.device).expand(query.shape[0], 1, rows, keys)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.medusa_like.tree_attention(query, key, value, visible, scale)
    return out.transpose(1, 2), None  # [B, T, H, D]


attention.register_backend(BACKEND, rows_attention)
