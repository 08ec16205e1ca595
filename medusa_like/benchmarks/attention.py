"""Attention benchmark: what a row-invariant attention would cost the compiled step, against the SDPA it runs.

    python -m eval.bench attention                                   # fp32 and bf16, 2..16 nodes, 300 and 1000 keys
    python -m eval.bench attention --nodes 2,4 --committed 300 --dtypes bfloat16

Greedy decoding on the compiled step (the reference of every method) computes each token in a one-node step; a tree
step computes the same token as one row of many. The compiled products give a row the same bits either way; the
attention does not: `scaled_dot_product_attention` sums a row's keys in an order that depends on the rows beside it,
the key count and where the masked keys sit, so a bf16 target's tree steps drift from its greedy steps and flip
near-ties (docs/cpu-kernels.md, "The compiled step on an AVX512-BF16 EPYC"). fp32 rows drift too, by far less: no
greedy token measured has flipped.

`row_invariant_attention` is an attention whose rows did not drift in any case checked, written in torch ops for
Inductor: row t, at position p, sums the committed keys before p - WINDOW + 1 in slot order (its own visibility
masks the rest to exact zeros), then the WINDOW positions up to p gathered into position order (committed slots,
then its tree ancestors'), in fp32. A one-node step and a tree row at the same position then add the same numbers in
the same order, whatever the tree's shape and size, provided one compiled graph (dynamic shapes, as the step's)
generates the same loops for both: eager, torch's own reductions may order them otherwise.

For each dtype, every row of each tree in TREES after each committed length in CHECKED_PREFIXES is compared bit for
bit with the same node computed as a one-node step (its ancestors committed in consecutive slots, a masked dummy row
after it, as `forward/compiled.py` pads one node), for both attentions; then both are timed, compiled, per decoder
layer. Not used by the step: at the measured price bf16 would lose its lead over fp32 (docs/cpu-kernels.md).
"""

from typing import Annotated

import torch
import torch.nn.functional as F

from .harness import Report, median_ms, table, use_threads

WINDOW = 64  # positions each row sums in position order: more than any tree step's depth (compiled.MAX_ROWS)
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


def row_invariant_attention(query, key, value, visible, scale: float):
    """The same contract as `sdpa_attention`; each row sums the keys it sees in position order, whatever the other
    rows (compiled, the bits matched its one-node step in every case checked: the module docstring). Committed slot s
    holds position s; a tree node's position is the first node's plus its depth (its ancestors in the tree block, less
    one)."""
    _, heads, rows, dim = query.shape
    kv_heads, live = key.shape[1], key.shape[2]
    committed, group = live - rows, heads // kv_heads
    device = query.device
    seen = visible[0, 0]  # [T, S]
    tree = seen[:, committed:]  # [T, T]
    ancestors = torch.sort((~tree).to(torch.int8), dim=-1, stable=True).indices  # [T, T]: seen tree slots first
    position = committed + tree.sum(-1) - 1  # [T]
    window = position[:, None] - (WINDOW - 1) + torch.arange(WINDOW, device=device)  # [T, W] positions
    in_tree = window >= committed
    depth = (window - committed).clamp(0, rows - 1)
    slot = torch.where(in_tree, committed + torch.gather(ancestors, 1, depth), window.clamp(min=0))  # [T, W]
    window_seen = (window >= 0) & torch.gather(seen, 1, slot)  # [T, W]
    before = torch.arange(committed, device=device)[None] < window[:, :1]  # [T, P]: left of the window
    prefix_seen = seen[:, :committed] & before  # [T, P]
    q = query[0].view(kv_heads, group, rows, dim).float()  # [H_kv, g, T, D]
    k, v = key[0].float(), value[0].float()  # [H_kv, S, D]
    k_window, v_window = k[:, slot], v[:, slot]  # [H_kv, T, W, D]
    scores_prefix = (q[:, :, :, None, :] * k[:, None, None, :committed]).sum(-1) * scale  # [H_kv, g, T, P]
    scores_window = (q[:, :, :, None, :] * k_window[:, None]).sum(-1) * scale  # [H_kv, g, T, W]
    scores_prefix = scores_prefix.masked_fill(~prefix_seen, float("-inf"))
    scores_window = scores_window.masked_fill(~window_seen, float("-inf"))
    top = torch.maximum(scores_prefix.amax(-1, keepdim=True), scores_window.amax(-1, keepdim=True))  # exact
    e_prefix, e_window = torch.exp(scores_prefix - top), torch.exp(scores_window - top)  # masked: exact zeros
    total = e_prefix.sum(-1, keepdim=True) + e_window.sum(-1, keepdim=True)  # [H_kv, g, T, 1]
    weighted = (e_prefix[..., None] * v[:, None, None, :committed]).sum(-2) + (
        e_window[..., None] * v_window[:, None]
    ).sum(-2)
    return (weighted / total).to(query.dtype).reshape(1, heads, rows, dim)


ATTENTIONS = {"sdpa": sdpa_attention, "row-invariant": row_invariant_attention}


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
    """One layer's attention, compiled: SDPA against a row-invariant one; ms, and rows drifting from one-node steps."""
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or any(not 2 <= n <= 64 for n in nodes) or any(c < 1 for c in committed) or heads % kv_heads:
        raise ValueError(
            f"dtypes are {list(DTYPES)} (got {list(dtypes)}); nodes 2..64 (got {list(nodes)}); committed >= 1; "
            f"heads a multiple of kv_heads (got {heads}, {kv_heads})"
        )
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
    notes = [f"a target of L decoder layers pays L times a row's difference a step; WINDOW = {WINDOW} positions"]
    result = {"nodes": list(nodes), "committed": list(committed), "threads": threads, "shape": list(shape),
              "ms": ms, "drifting_rows": drift, "rows_checked": rows_checked}  # fmt: skip
    return Report(result, tables, notes, out=out)
