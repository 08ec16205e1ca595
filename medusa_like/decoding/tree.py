"""Tree specs: static token trees (validation, compilation into index buffers, presets, greedy construction) and the
parameters of EAGLE-2's dynamic tree.

A tree is a list of paths of top-k ranks (Medusa's "choices"): `[1, 0]` is the node reached by taking head 1's
second-best token and then head 2's best token. Depth d uses head d. Node 0 is the root, the target's own next token;
nodes 1.. are the paths sorted by (depth, ranks). Compiling a tree once gives everything a decoding step needs:

    attention_mask   [T, T] bool   node i sees node j iff j is i or one of its ancestors (the root is everyone's)
    depth            [T]           0 for the root; position id of node i = committed length + depth[i]
    candidate_index  [T-1]         index of node i+1's token in the heads' flattened top-k [K * top_k]
    retrieve         [P, D+1]      node indices root -> leaf for each of the P leaves, padded with -1
    parents, ranks   [T]           each node's parent (-1 for the root) and the rank of its own token

A `TokenTree` is also the static tree spec that `draft_tree.grow_static` fills from any drafter.
"""

import heapq
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from medusa_like.io import write_json

Path_ = tuple[int, ...]


class InvalidTreeError(ValueError):
    pass


def validate_paths(paths, num_heads: int | None = None, top_k: int | None = None) -> list[Path_]:
    """Check a list of rank paths and return it as tuples; raise InvalidTreeError naming the first bad path."""
    if not isinstance(paths, (list, tuple)):
        raise InvalidTreeError(f"a tree is a list of paths of top-k ranks, got {type(paths).__name__}")
    seen: set[Path_] = set()
    out = []
    for raw in paths:
        if not isinstance(raw, (list, tuple)) or len(raw) == 0:
            raise InvalidTreeError(f"path {raw!r} is not a non-empty list of ranks")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in raw):
            raise InvalidTreeError(f"path {list(raw)} holds a rank that is not an integer")
        path = tuple(raw)
        if any(r < 0 for r in path):
            raise InvalidTreeError(f"path {list(path)} holds a negative rank")
        if path in seen:
            raise InvalidTreeError(f"path {list(path)} appears twice")
        if num_heads is not None and len(path) > num_heads:
            raise InvalidTreeError(f"path {list(path)} has depth {len(path)} but there are only {num_heads} heads")
        if top_k is not None and max(path) >= top_k:
            raise InvalidTreeError(f"path {list(path)} uses rank {max(path)} but top_k is {top_k}")
        seen.add(path)
        out.append(path)
    for path in out:
        if len(path) > 1 and path[:-1] not in seen:
            raise InvalidTreeError(f"path {list(path)} has no parent: {list(path[:-1])} is missing from the tree")
    return out


@dataclass(frozen=True)
class DynamicTreeSpec:
    """EAGLE-2's dynamic tree: `depth` drafter passes, `top_k` nodes expanded per depth, `num_nodes` verified."""

    depth: int = 4
    top_k: int = 4
    num_nodes: int = 16  # drafted nodes verified, the root excluded

    def __post_init__(self):
        for name in ("depth", "top_k", "num_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DynamicTreeSpec.{name} must be a positive integer, got {value!r}")

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_nodes(self) -> int:
        """Nodes of the largest tree this spec verifies, the root included (sizes the KV cache)."""
        return self.num_nodes + 1


@dataclass
class TokenTree:
    """A compiled tree. Build with `TokenTree.from_paths(paths)`; move with `.to(device)`."""

    paths: list[Path_]
    attention_mask: torch.Tensor  # [T, T] bool
    depth: torch.Tensor  # [T] long
    candidate_index: torch.Tensor  # [T-1] long
    retrieve: torch.Tensor  # [P, D+1] long, -1 padded
    top_k: int  # ranks needed from each head
    max_depth: int  # heads needed
    parents: torch.Tensor  # [T] long, -1 for the root
    ranks: torch.Tensor  # [T] long, the rank of each node's token among its parent's candidates (0 for the root)

    @property
    def num_nodes(self) -> int:
        return self.depth.numel()

    def level(self, depth: int) -> torch.Tensor:
        """Node indices at `depth` [n_d] (contiguous: nodes are sorted by depth)."""
        return (self.depth == depth).nonzero().flatten()

    @cached_property
    def children(self) -> list[list[int]]:
        """Child node indices of every node, in rank order (used by sampling verification)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for p, i in index.items():
            kids[index[p[:-1]] if len(p) > 1 else 0].append(i)
        return kids

    @classmethod
    def from_paths(cls, paths, num_heads: int | None = None, top_k: int | None = None) -> "TokenTree":
        paths = sorted(validate_paths(paths, num_heads, top_k), key=lambda p: (len(p), p))
        index = {p: i + 1 for i, p in enumerate(paths)}
        num_nodes = len(paths) + 1
        need_k = max((max(p) for p in paths), default=-1) + 1
        top_k = top_k if top_k is not None else max(need_k, 1)
        max_depth = max((len(p) for p in paths), default=0)

        mask = torch.eye(num_nodes, dtype=torch.bool)
        mask[:, 0] = True
        depth = torch.zeros(num_nodes, dtype=torch.long)
        candidate_index = torch.zeros(num_nodes - 1, dtype=torch.long)
        parents = torch.full((num_nodes,), -1, dtype=torch.long)
        ranks = torch.zeros(num_nodes, dtype=torch.long)
        for p, i in index.items():
            depth[i] = len(p)
            parents[i] = index[p[:-1]] if len(p) > 1 else 0
            ranks[i] = p[-1]
            candidate_index[i - 1] = (len(p) - 1) * top_k + p[-1]
            for d in range(1, len(p)):
                mask[i, index[p[:d]]] = True

        inner = {p[:-1] for p in paths}
        leaves = [p for p in paths if p not in inner] or [()]
        retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            retrieve[row, 0] = 0
            for d in range(1, len(leaf) + 1):
                retrieve[row, d] = index[leaf[:d]]
        return cls(paths, mask, depth, candidate_index, retrieve, top_k, max_depth, parents, ranks)

    def to(self, device) -> "TokenTree":
        return TokenTree(
            self.paths,
            self.attention_mask.to(device),
            self.depth.to(device),
            self.candidate_index.to(device),
            self.retrieve.to(device),
            self.top_k,
            self.max_depth,
            self.parents.to(device),
            self.ranks.to(device),
        )


# ---------------------------------------------------------------------------------------------------------------------
# Building trees


def chain(depth: int) -> list[Path_]:
    """Top-1 of each head, one after the other: [[0], [0, 0], ...]."""
    return [(0,) * d for d in range(1, depth + 1)]


def greedy_tree(rank_accuracy: list[list[float]], num_nodes: int) -> list[Path_]:
    """The tree of `num_nodes` candidate nodes that maximises expected acceptance length.

    `rank_accuracy[d][r]` is the probability that head d+1's rank-r token is the right one. Assuming heads are
    independent, a path is accepted with the product of its ranks' probabilities, and the expected number of accepted
    draft tokens is the sum of those products over the tree. Adding nodes best-first (a child is never more probable
    than its parent) gives the optimal tree for that objective, and always a valid one.
    """
    num_heads = len(rank_accuracy)
    frontier = [(-acc, (r,)) for r, acc in enumerate(rank_accuracy[0])] if num_heads else []
    heapq.heapify(frontier)
    chosen: list[Path_] = []
    while frontier and len(chosen) < num_nodes:
        neg_p, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < num_heads:
            for r, acc in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(frontier, (neg_p * acc, path + (r,)))
    return chosen


def expected_acceptance(paths, rank_accuracy: list[list[float]]) -> float:
    """Expected accepted draft tokens per step under independent heads (add 1 for the bonus token to get tau)."""
    total = 0.0
    for path in paths:
        p = 1.0
        for d, r in enumerate(path):
            p *= rank_accuracy[d][r] if r < len(rank_accuracy[d]) else 0.0
        total += p
    return total


# A prior used only to shape the presets: head d's rank-r accuracy falls with depth and rank, roughly as measured for
# Medusa-1 heads (top-1 about 0.6 for head 1, lower for later heads).
_PRIOR = [[0.60 * 0.55**r for r in range(10)], *[[(0.45 - 0.08 * d) * 0.6**r for r in range(10)] for d in range(4)]]

DEFAULT_DEPTH = 4  # static presets for a drafter of any depth

PRESETS = {
    "chain": lambda num_heads: chain(num_heads),
    "small": lambda num_heads: greedy_tree(_PRIOR[: max(num_heads, 1)], 15),
    "medusa": lambda num_heads: greedy_tree(_PRIOR[: max(num_heads, 1)], 63),
}


def save_tree(paths, path, **meta) -> Path:
    """Write a tree as JSON: {"paths": [[0], [1], [0, 0], ...], **meta}."""
    return write_json(path, {"paths": [list(p) for p in paths], **meta})


def load_tree(path) -> "list[Path_] | DynamicTreeSpec":
    """Read a tree written by `save_tree` (a static tree, or a dynamic one under "dynamic"; or a bare list of paths)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tree file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise InvalidTreeError(f"tree file {str(path)!r} is not valid JSON: {err}") from err
    if isinstance(data, dict) and "dynamic" in data:
        try:
            return DynamicTreeSpec(**data["dynamic"])
        except TypeError as err:
            raise InvalidTreeError(f"tree file {str(path)!r}: bad dynamic tree {data['dynamic']!r}: {err}") from err
    paths = data["paths"] if isinstance(data, dict) and "paths" in data else data
    return validate_paths(paths)


def resolve_tree(tree, num_heads: int | None) -> "TokenTree | DynamicTreeSpec":
    """A tree spec from a preset name ('dynamic', 'chain', 'small', 'medusa', 'none'), a JSON tree file (a static
    tree or `{"dynamic": {...}}`), a list of rank paths, a dict of `DynamicTreeSpec` fields, or a spec itself.

    `num_heads` bounds static trees (Medusa's heads); None means a drafter of any depth (EAGLE-3), for which the
    static presets are built `DEFAULT_DEPTH` deep.
    """
    depth = num_heads if num_heads is not None else DEFAULT_DEPTH
    if isinstance(tree, DynamicTreeSpec):
        spec = tree
    elif isinstance(tree, dict):
        spec = DynamicTreeSpec(**tree)
    elif tree == "dynamic":
        spec = DynamicTreeSpec(depth=min(DynamicTreeSpec.depth, depth))
    elif isinstance(tree, TokenTree):
        spec = tree
    elif tree is None or tree == "none":
        return TokenTree.from_paths([], num_heads)
    elif isinstance(tree, (str, Path)) and str(tree).endswith(".json"):
        return resolve_tree(load_tree(tree), num_heads)
    elif isinstance(tree, str):
        if tree not in PRESETS:
            raise InvalidTreeError(
                f"unknown tree preset {tree!r}; choose from {sorted([*PRESETS, 'dynamic', 'none'])} or pass a list "
                "of paths"
            )
        return TokenTree.from_paths(PRESETS[tree](depth), num_heads)
    else:
        return TokenTree.from_paths([list(p) for p in tree], num_heads)
    if num_heads is not None and spec.max_depth > num_heads:
        raise InvalidTreeError(f"tree has depth {spec.max_depth} but there are only {num_heads} heads")
    return spec
