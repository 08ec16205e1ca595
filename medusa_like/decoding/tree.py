"""Tree specs: what a decoding step may draft and verify. One interface (`TreeSpec`), three kinds:

    TokenTree          a static tree of rank paths (Medusa's "choices"), compiled once into index buffers
    DynamicTreeSpec    EAGLE-2's dynamic tree: depth, top-k expanded per depth, nodes verified
    BudgetedTreeSpec   a learned drafter's tree merged with lookup continuations, cut to a node budget

Every spec answers the same questions, each in one place: how deep (`max_depth`), how many nodes the target verifies
(`max_nodes`, root included: sizes the target's KV cache), how many nodes a drafter may create while growing it
(`drafted_nodes`) and how many of its own cache entries that writes (`cache_entries`), how many ranks each expanded
node needs (`top_k`), whether a drafter can fill it (`check_drafter`), how to grow it from a drafter's `expand`
(`grow`) and how to write it as JSON (`to_json`; reading it back, files and preset names are `tree_files.py`).

A tree is a list of paths of top-k ranks (Medusa's "choices"): `[1, 0]` is the node reached by taking head 1's
second-best token and then head 2's best token. Depth d uses head d. Node 0 is the root, the target's own next token;
nodes 1.. are the paths sorted by (depth, ranks). Compiling a tree once gives everything a decoding step needs:

    attention_mask   [T, T] bool   node i sees node j iff j is i or one of its ancestors (the root is everyone's)
    depth            [T]           0 for the root; position id of node i = committed length + depth[i]
    retrieve         [P, D+1]      node indices root -> leaf for each of the P leaves, padded with -1
    parents, ranks   [T]           each node's parent (-1 for the root) and the rank of its own token

A `TokenTree` is also the static tree spec that `draft_tree.grow_static` fills from any drafter. Static trees built
from rank accuracies (chains, greedy best-first trees) and the named presets are `tree_presets.py`.
"""

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .cost_model import BatchShare
from .draft_tree import DraftTree, Expand, grow_dynamic, grow_static
from .tree_presets import Path_

# Sizes no step could use, refused when a spec is made: a step verifies its nodes in one target forward with a
# [T, T] mask and reserves T KV cache slots (cost models pick budgets of tens of nodes), and a dynamic tree keeps a few
# buffers of its drafted nodes.
MAX_TREE_NODES = 4096  # nodes a step verifies, the root excluded
MAX_DRAFTED_NODES = 1 << 20  # nodes a dynamic tree drafts before keeping its best, the root included
DEFAULT_NUM_NODES = 16  # nodes a dynamic or budgeted tree verifies, the root excluded, when it names no number
DEFAULT_LOOKUP_DEPTH = 8  # how deep lookup continuations go in a budgeted tree that names no depth


class InvalidTreeError(ValueError):
    pass


def validate_paths(paths) -> list[Path_]:
    """Check a list of rank paths and return it as tuples; raise InvalidTreeError naming the first bad path."""
    if not isinstance(paths, (list, tuple)):
        raise InvalidTreeError(f"a tree is a list of paths of top-k ranks, got {type(paths).__name__}")
    if len(paths) > MAX_TREE_NODES:
        raise InvalidTreeError(f"a tree of {len(paths)} nodes is more than a step verifies: at most {MAX_TREE_NODES}")
    seen: set[Path_] = set()
    out = []
    for raw in paths:
        if not isinstance(raw, (list, tuple)) or len(raw) == 0:
            raise InvalidTreeError(f"path {raw!r} is not a non-empty list of ranks")
        if not all(isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in raw):  # numpy's ints too
            raise InvalidTreeError(f"path {list(raw)} holds a rank that is not an integer")
        path = tuple(int(r) for r in raw)
        if any(r < 0 for r in path):
            raise InvalidTreeError(f"path {list(path)} holds a negative rank")
        if path in seen:
            raise InvalidTreeError(f"path {list(path)} appears twice")
        seen.add(path)
        out.append(path)
    for path in out:
        if len(path) > 1 and path[:-1] not in seen:
            raise InvalidTreeError(f"path {list(path)} has no parent: {list(path[:-1])} is missing from the tree")
    return out


class TreeSpec(Protocol):
    """What every tree spec answers (see the module docstring)."""

    max_depth: int
    max_nodes: int
    drafted_nodes: int
    cache_entries: int
    top_k: int

    def grow(self, root: torch.Tensor, expand: Expand) -> DraftTree: ...

    def to_json(self) -> dict: ...

    def to(self, device) -> "TreeSpec": ...

    @property
    def label(self) -> str:
        """A short name for tables and logs."""
        ...

    @property
    def learned_part(self) -> "TreeSpec":
        """The part a drafter's ranked candidates fill (lookup continuations of a budgeted tree need no ranks)."""
        ...


def check_drafter(spec: TreeSpec, max_depth: int | None, max_rank: int | None, what: str = "the drafter") -> None:
    """Refuse, before anything runs, a tree the drafter cannot fill: deeper than `max_depth` (Medusa: its heads) or
    needing more than `max_rank` candidates per node (its top-k: the draft vocabulary's size)."""
    spec = spec.learned_part
    if max_depth is not None and spec.max_depth > max_depth:
        raise InvalidTreeError(f"tree has depth {spec.max_depth} but {what} drafts at most {max_depth} deep")
    if max_rank is not None and spec.top_k > max_rank:
        raise InvalidTreeError(
            f"tree needs rank {spec.top_k - 1} (top-{spec.top_k}) but {what} proposes at most {max_rank} tokens per node"
        )


def reach(spec: TreeSpec) -> int:
    """How many positions past the committed text a step's nodes can reach: the tree's depth, and never more than its
    non-root nodes (a path of n nodes is n deep), whatever depth lookup may search."""
    return min(spec.max_depth, spec.max_nodes - 1)


def check_budget(owner: str, num_nodes: int) -> None:
    if num_nodes > MAX_TREE_NODES:
        raise InvalidTreeError(
            f"{owner}.num_nodes={num_nodes} is more than a step verifies: at most {MAX_TREE_NODES} (MAX_TREE_NODES)"
        )


@dataclass(frozen=True)
class DynamicTreeSpec:
    """EAGLE-2's dynamic tree: `depth` drafter passes, `top_k` nodes expanded per depth, `num_nodes` verified."""

    depth: int = 4
    top_k: int = 4
    num_nodes: int = DEFAULT_NUM_NODES  # drafted nodes verified, the root excluded

    def __post_init__(self):
        for name in ("depth", "top_k", "num_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DynamicTreeSpec.{name} must be a positive integer, got {value!r}")
        check_budget("DynamicTreeSpec", self.num_nodes)
        if self.drafted_nodes > MAX_DRAFTED_NODES:
            raise InvalidTreeError(
                f"DynamicTreeSpec(depth={self.depth}, top_k={self.top_k}) drafts {self.drafted_nodes} nodes per step "
                f"(1 + top_k + (depth - 1) * top_k**2): at most {MAX_DRAFTED_NODES} (MAX_DRAFTED_NODES)"
            )

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_nodes(self) -> int:
        """Nodes of the largest tree this spec verifies, the root included (sizes the KV cache)."""
        return self.num_nodes + 1

    @property
    def drafted_nodes(self) -> int:
        """Nodes grown before the best `num_nodes` are kept: the root, top_k children, then top_k**2 per depth."""
        return 1 + self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def cache_entries(self) -> int:
        """Drafter-cache entries of one step: the `top_k` expanded nodes of each depth below the last."""
        return (self.depth - 1) * self.top_k

    def grow(self, root: torch.Tensor, expand: Expand) -> DraftTree:
        return grow_dynamic(self, root, expand)

    def to_json(self) -> dict:
        return {"dynamic": {"depth": self.depth, "top_k": self.top_k, "num_nodes": self.num_nodes}}

    def to(self, device) -> "DynamicTreeSpec":
        return self  # no buffers: the tree is compiled per step on the drafter's device

    @property
    def label(self) -> str:
        return f"d{self.depth}k{self.top_k}n{self.num_nodes}"

    @property
    def learned_part(self) -> "DynamicTreeSpec":
        return self


@dataclass
class TokenTree:
    """A compiled tree. Build with `TokenTree.from_paths(paths)`; move with `.to(device)`."""

    paths: list[Path_]
    attention_mask: torch.Tensor  # [T, T] bool
    depth: torch.Tensor  # [T] long
    retrieve: torch.Tensor  # [P, D+1] long, -1 padded
    top_k: int  # ranks needed per expanded node (the largest rank + 1)
    max_depth: int
    parents: torch.Tensor  # [T] long, -1 for the root
    ranks: torch.Tensor  # [T] long, the rank of each node's token among its parent's candidates (0 for the root)

    @property
    def num_nodes(self) -> int:
        return self.depth.numel()

    def level(self, depth: int) -> torch.Tensor:
        """Node indices at `depth` [n_d] (contiguous: nodes are sorted by depth)."""
        return (self.depth == depth).nonzero().flatten()

    @property
    def max_nodes(self) -> int:
        return self.num_nodes

    @property
    def drafted_nodes(self) -> int:
        return self.num_nodes

    @property
    def cache_entries(self) -> int:
        """Drafter-cache entries of one step: every node that has children, the root excluded."""
        return int((self.parents[1:].unique() > 0).sum())

    def grow(self, root: torch.Tensor, expand: Expand) -> DraftTree:
        return grow_static(self, root, expand)

    def to_json(self) -> dict:
        return {"paths": [list(p) for p in self.paths]}

    @property
    def learned_part(self) -> "TokenTree":
        return self

    @property
    def label(self) -> str:
        return f"static{self.num_nodes - 1}"

    @classmethod
    def from_paths(cls, paths) -> "TokenTree":
        paths = sorted(validate_paths(paths), key=lambda p: (len(p), p))
        index = {p: i + 1 for i, p in enumerate(paths)}
        num_nodes = len(paths) + 1
        top_k = max((max(p) for p in paths), default=0) + 1
        max_depth = max((len(p) for p in paths), default=0)

        mask = torch.eye(num_nodes, dtype=torch.bool)
        mask[:, 0] = True
        depth = torch.zeros(num_nodes, dtype=torch.long)
        parents = torch.full((num_nodes,), -1, dtype=torch.long)
        ranks = torch.zeros(num_nodes, dtype=torch.long)
        for p, i in index.items():
            depth[i] = len(p)
            parents[i] = index[p[:-1]] if len(p) > 1 else 0
            ranks[i] = p[-1]
            for d in range(1, len(p)):
                mask[i, index[p[:d]]] = True

        inner = {p[:-1] for p in paths}
        leaves = [p for p in paths if p not in inner] or [()]
        retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            retrieve[row, 0] = 0
            for d in range(1, len(leaf) + 1):
                retrieve[row, d] = index[leaf[:d]]
        return cls(paths, mask, depth, retrieve, top_k, max_depth, parents, ranks)

    def to(self, device) -> "TokenTree":
        return TokenTree(
            self.paths,
            self.attention_mask.to(device),
            self.depth.to(device),
            self.retrieve.to(device),
            self.top_k,
            self.max_depth,
            self.parents.to(device),
            self.ranks.to(device),
        )


@dataclass(frozen=True)
class BudgetedTreeSpec:
    """One tree from several sources (`drafters/merged_tree.py`): a learned drafter's tree (`learned`, static or dynamic;
    None for lookup alone) and lookup continuations up to `lookup_depth` deep, merged by prefix; of all their nodes the
    best by estimated chance of acceptance are verified, at most `num_nodes` (the step's own budget is picked by a
    cost model, and may be smaller)."""

    learned: "TokenTree | DynamicTreeSpec | None" = None
    num_nodes: int = DEFAULT_NUM_NODES  # verified nodes, the root excluded, at most
    lookup_depth: int = DEFAULT_LOOKUP_DEPTH
    # in a batch, what the other rows verify in the same forward (`in_batch`): a step's context, not part of the tree
    shared: BatchShare | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("num_nodes", "lookup_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidTreeError(f"BudgetedTreeSpec.{name} must be a positive integer, got {value!r}")
        check_budget("BudgetedTreeSpec", self.num_nodes)

    @property
    def learned_part(self) -> "TokenTree | DynamicTreeSpec":
        return self.learned if self.learned is not None else TokenTree.from_paths([])

    @property
    def max_depth(self) -> int:
        return max(self.learned_part.max_depth, self.lookup_depth)

    @property
    def max_nodes(self) -> int:
        return self.num_nodes + 1

    @property
    def drafted_nodes(self) -> int:
        return self.learned_part.drafted_nodes

    @property
    def cache_entries(self) -> int:
        return self.learned_part.cache_entries

    @property
    def top_k(self) -> int:
        return self.learned_part.top_k

    def grow(self, root: torch.Tensor, expand: Expand) -> DraftTree:
        """The learned drafter's part of the tree."""
        return self.learned_part.grow(root, expand)

    def to_json(self) -> dict:
        learned = None if self.learned is None else self.learned.to_json()
        return {"budgeted": {"num_nodes": self.num_nodes, "lookup_depth": self.lookup_depth, "learned": learned}}

    @property
    def label(self) -> str:
        learned = "" if self.learned is None else f"{self.learned.label}+"
        return f"{learned}lookup{self.lookup_depth}n{self.num_nodes}"

    def to(self, device) -> "BudgetedTreeSpec":
        learned = None if self.learned is None else self.learned.to(device)
        return BudgetedTreeSpec(learned, self.num_nodes, self.lookup_depth)


def in_batch(spec: TreeSpec, share: BatchShare) -> TreeSpec:
    """`spec` for one row of a batch step whose other rows verify `share` in the same forward: a budgeted tree is
    priced by the batch's nodes (`cost_model.BatchShare`); any other spec is the same tree in a batch."""
    return dataclasses.replace(spec, shared=share) if isinstance(spec, BudgetedTreeSpec) else spec


def is_plain(spec: TreeSpec) -> bool:
    """Whether `spec` is plain decoding: the root alone, nothing drafted (`tree="none"`)."""
    return spec.max_nodes == 1


def budgeted(spec: TreeSpec, lookup_depth: int = DEFAULT_LOOKUP_DEPTH, keep_learned: bool = True) -> BudgetedTreeSpec:
    """`spec` as a budgeted tree that verifies as many nodes as `spec` does, with `spec` as its learned part (or
    none, for lookup alone); a budgeted spec keeps its own settings."""
    if isinstance(spec, BudgetedTreeSpec):
        return (
            spec if keep_learned or spec.learned is None else BudgetedTreeSpec(None, spec.num_nodes, spec.lookup_depth)
        )
    learned = spec if keep_learned and spec.max_depth > 0 else None
    return BudgetedTreeSpec(learned, max(spec.max_nodes - 1, 1), max(lookup_depth, spec.max_depth))
