"""Attention benchmark: the compiled step's row-invariant attention kernel against the SDPA it replaced.

    python -m eval.bench attention                                   # fp32 and bf16, 2..16 nodes, 300 and 1000 keys
    python -m eval.bench attention --nodes 2,4 --committed 300 --dtypes bfloat16

Greedy decoding on the compiled step (the reference of every method) computes each token in a one-node step; a tree
step computes the same token as one row of many. `scaled_dot_product_attention` sums a row's keys in an order that
depends on the rows beside it, the key count and where the masked keys sit, so a bf16 target's tree steps drifted
from its greedy steps and flipped near-ties; the step now attends by `forward/cpu/tree_attention.py`'s kernel, which
computes every row alone (docs/cpu-kernels.md, "The attention kernel").

For each dtype, every row of each tree in TREES after each committed length in CHECKED_PREFIXES is compared bit for
bit with the same node computed as a one-node step (its ancestors committed in consecutive slots, a masked dummy row
after it, as `forward/compiled.py` pads one node), for both attentions; then both are timed per decoder layer, each
inside a graph compiled over dynamic shapes, as the step runs them.
"""

from typing import Annotated

import torch
import torch.nn.functional as F

from medusa_like.forward.cpu import tree_attention

from .harness import Report, median_ms, table, use_threads

TREES = {  # parents of each node (-1: the root), in the order a tree step lays its nodes in slots
    "chain of 4": [-1, 0, 1, 2],
    "chain of 8": [-1, 0, 1, 2, 3, 4, 5, 6],
    "binary, 7 nodes": [-1, 0, 0, 1, 1, 2, 2],
    "root and 5 children": [-1, 0, 0, 0, 0, 0],
    "mixed, 12 nodes": [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 6, 9],
}
CHECKED_PREFIXES = (37, 64, 65, 300, 301)  # committed lengths the bit-for-bit check runs after
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sdpa_attention(query, key, value, visible, scale: float):
    """The step's attention (`compiled.static_attention` without soft-capping): query [1, H, T, D], key and value
    [1, H_kv, S, D] (the step's T entries in the last T slots), visible [1, 1, T, S] -> [1, H, T, D]."""
    gqa = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale, enable_gqa=gqa)


def kernel_attention(query, key, value, visible, scale: float):
    """The step's attention on CPUs now: the same contract, each row computed alone (`forward/cpu/tree_attention.py`)."""
    return torch.ops.medusa_like.tree_attention(query, key, value, visible, scale)


ATTENTIONS = {"sdpa": sdpa_attention, "kernel": kernel_attention}


def tree_inputs(parents: list[int], committed: int, heads: int, kv_heads: int, dim: int, dtype, seed: int = 0):
    """(query, key, value, visible) of a tree step of `parents` after `committed` entries, random entries, and the
    ancestor mask [T, T] (a node sees itself)."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(parents)
    seen = torch.eye(rows, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            seen[node] |= seen[parent]
    query = torch.randn(1, heads, rows, dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, committed + rows, dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, committed + rows, dim, generator=generator).to(dtype)
    visible = torch.cat([torch.ones(rows, committed, dtype=torch.bool), seen], 1)[None, None]
    return query, key, value, visible, seen


def drifting_rows(attention, parents: list[int], committed: int, heads: int, kv_heads: int, dim: int, dtype) -> int:
    """How many rows of a tree step differ by any bit from the same node as a one-node step: its ancestors' entries
    committed in consecutive slots after the same `committed` ones, a dummy row after it that sees only itself."""
    query, key, value, visible, seen = tree_inputs(parents, committed, heads, kv_heads, dim, dtype)
    scale = dim**-0.5
    tree_out = attention(query, key, value, visible, scale)  # [1, H, T, D]
    drifting = 0
    for node in range(len(parents)):
        path = seen[node].nonzero().flatten() + committed  # its ancestors' slots and its own, in depth order
        slots = torch.cat([torch.arange(committed), path])
        dummy = torch.zeros(1, kv_heads, 1, dim, dtype=dtype)
        k = torch.cat([key[:, :, slots], dummy], 2)
        v = torch.cat([value[:, :, slots], dummy], 2)
        q = torch.cat([query[:, :, node : node + 1], query[:, :, :1]], 2)  # [1, H, 2, D]: the node, a dummy
        length = len(slots)
        mask = torch.zeros(2, length + 1, dtype=torch.bool)
        mask[0, :length], mask[1, length] = True, True
        single = attention(q, k, v, mask[None, None], scale)
        drifting += int(not torch.equal(single[:, :, 0], tree_out[:, :, node]))
    return drifting


def timing_inputs(rows: int, committed: int, heads: int, kv_heads: int, dim: int, dtype):
    """A chain of `rows` nodes after `committed` entries: the step's shapes at that size."""
    return tree_inputs(list(range(-1, rows - 1)), committed, heads, kv_heads, dim, dtype)[:4]


def layer_ms(attention, inputs: tuple, scale: float, repeats: int) -> float:
    """Median ms of one call of `attention` on `inputs` (query, key, value, visible), after 5 warm-up calls."""
    return median_ms(lambda: attention(*inputs, scale), repeats, warmup=5)


def run(
    *,
    nodes: Annotated[tuple[int, ...], "rows of a step, 2..64"] = (2, 4, 8, 16),
    committed: Annotated[tuple[int, ...], "committed keys before the step"] = (300, 1000),
    dtypes: Annotated[tuple[str, ...], "of float32, bfloat16"] = ("float32", "bfloat16"),
    heads: Annotated[int, "query heads (default: SmolLM2-135M's)"] = 9,
    kv_heads: int = 3,
    head_dim: int = 64,
    repeats: int = 100,
    threads: int | None = None,
    out: str = "bench_attention.json",
) -> Report:
    """One layer's attention, compiled: SDPA against the step's kernel; ms, and rows drifting from one-node steps."""
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or any(not 2 <= n <= 64 for n in nodes) or any(c < 1 for c in committed) or heads % kv_heads:
        raise ValueError(
            f"dtypes are {list(DTYPES)} (got {list(dtypes)}); nodes 2..64 (got {list(nodes)}); committed >= 1; "
            f"heads a multiple of kv_heads (got {heads}, {kv_heads})"
        )
    why = tree_attention.unavailable()
    if why is not None:
        raise RuntimeError(why)
    threads = use_threads(threads)
    shape = (heads, kv_heads, head_dim)
    compiled = {name: torch.compile(fn, dynamic=True) for name, fn in ATTENTIONS.items()}  # one graph, as the step's
    drift: dict[str, dict[str, int]] = {}
    ms: dict[str, dict[str, list[float]]] = {}
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for name, attention in compiled.items():
            drift[f"{name}, {dtype_name}"] = {
                tree: sum(drifting_rows(attention, parents, c, *shape, dtype) for c in CHECKED_PREFIXES)
                for tree, parents in TREES.items()
            }
            for keys in committed:
                ms.setdefault(f"{name}, {dtype_name}", {})[str(keys)] = [
                    layer_ms(attention, timing_inputs(n, keys, *shape, dtype), head_dim**-0.5, repeats) for n in nodes
                ]
    time_rows = [
        [way, str(keys), *(f"{t:.3f}" for t in times)] for way, by_keys in ms.items() for keys, times in by_keys.items()
    ]
    rows_checked = {tree: len(parents) * len(CHECKED_PREFIXES) for tree, parents in TREES.items()}
    drift_rows = [[way, *(f"{n} / {rows_checked[t]}" for t, n in counts.items())] for way, counts in drift.items()]
    tables = [
        table(
            f"one layer's attention, compiled, ms ({heads} heads, {kv_heads} kv heads, dim {head_dim}, "
            f"{threads} threads)",
            ["attention", "committed keys", *(f"{n} nodes" for n in nodes)],
            time_rows,
        ),
        table(
            f"tree rows differing from the same node's one-node step (after {', '.join(map(str, CHECKED_PREFIXES))} "
            "committed keys)",
            ["attention", *TREES],
            drift_rows,
        ),
    ]
    notes = ["a target of L decoder layers pays L times a row's difference a step"]
    result = {"nodes": list(nodes), "committed": list(committed), "threads": threads, "shape": list(shape),
              "ms": ms, "drifting_rows": drift, "rows_checked": rows_checked}  # fmt: skip
    return Report(result, tables, notes, out=out)
