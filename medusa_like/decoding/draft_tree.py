"""Per-step draft trees: a drafter's candidates as (tokens, parents), compiled for one verification forward.

A `DraftTree` is what the target verifies in a step. Node 0 is the root (the target's own next token); every other
node has a parent with a smaller index, so nodes are in topological order. Compiling gives what verification needs:

    attention_mask   [T, T] bool   node i sees node j iff j is i or one of its ancestors
    depth            [T]           position id of node i = committed length + depth[i]
    retrieve         [P, D+1]      node indices root -> leaf for each of the P leaves, padded with -1
    children         list[list]    child node indices of every node, best first (sampling verification)

Two ways to grow one from a drafter, which only has to answer `expand(frontier, tokens, parents, depth)` with the
top-k next tokens and their log-probabilities after each frontier node:

    grow_static(tree, root, expand)    the nodes of a fixed `TokenTree` of rank paths (Medusa's "choices")
    grow_dynamic(spec, root, expand)   EAGLE-2: at each depth expand the `top_k` best nodes by cumulative
                                       log-probability, then keep the `num_nodes` best drafted nodes

Both trees are ancestor-closed, so any of them is verified exactly as a static tree is: the output stays lossless.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from .tree import DynamicTreeSpec, TokenTree

# expand(frontier [F] node ids, tokens [n], parents [n], depth of the children) -> (tokens [F, k], logp [F, k])
Expand = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [T] long, node 0 = root
    parents: torch.Tensor  # [T] long, -1 for the root
    depth: torch.Tensor  # [T] long
    attention_mask: torch.Tensor  # [T, T] bool
    retrieve: torch.Tensor  # [P, D+1] long, -1 padded
    node_ids: torch.Tensor | None = None  # [T]: each node's id while it was grown (dynamic trees keep a subset)

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return self.retrieve.shape[1] - 1

    @cached_property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for child, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                kids[parent].append(child)
        return kids

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor) -> "DraftTree":
        """Compile a tree from node tokens [T] and parents [T] (parents[0] = -1, parents[i] < i)."""
        num_nodes = tokens.numel()
        parent_list = parents.tolist()
        if parent_list[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parent_list) if i > 0):
            raise ValueError(f"parents must be -1 for the root and point to an earlier node, got {parent_list}")
        depth_list = [0] * num_nodes
        for i in range(1, num_nodes):
            depth_list[i] = depth_list[parent_list[i]] + 1
        device = tokens.device
        depth = torch.tensor(depth_list, dtype=torch.long, device=device)
        mask = torch.eye(num_nodes, dtype=torch.bool, device=device)
        rows = torch.arange(num_nodes, device=device)
        hop = parents.clone()  # [T]: the ancestor `step` levels up, -1 past the root
        for _ in range(max(depth_list)):
            up = hop >= 0
            mask[rows[up], hop[up]] = True
            hop = torch.where(up, parents[hop.clamp(min=0)], hop)
        is_parent = torch.zeros(num_nodes, dtype=torch.bool, device=device)
        is_parent[parents[1:]] = True
        leaves = (~is_parent).nonzero().flatten()  # [P]
        path_rows, nodes = mask[leaves].nonzero(as_tuple=True)  # every (leaf, ancestor-or-self) pair
        retrieve = torch.full((leaves.numel(), max(depth_list) + 1), -1, dtype=torch.long, device=device)
        retrieve[path_rows, depth[nodes]] = nodes
        return cls(tokens, parents, depth, mask, retrieve)

    @classmethod
    def from_static(cls, tree: TokenTree, tokens: torch.Tensor) -> "DraftTree":
        """The tokens [T] of a static tree's nodes, with the static tree's precompiled buffers."""
        return cls(tokens, tree.parents, tree.depth, tree.attention_mask, tree.retrieve)


# ---------------------------------------------------------------------------------------------------------------------
# Growing trees from a drafter


def grow_static(tree: TokenTree, root: torch.Tensor, expand: Expand) -> DraftTree:
    """Fill a static tree of rank paths: node p's token is rank p[-1] of the drafter's top-k after its parent."""
    device = root.device
    tokens = torch.empty(tree.num_nodes, dtype=torch.long, device=device)
    tokens[0] = root
    parents, ranks = tree.parents, tree.ranks
    for depth in range(1, tree.max_depth + 1):
        level = tree.level(depth)  # [n_d] node ids at this depth
        frontier, slot = parents[level].unique(return_inverse=True)  # [F], [n_d]
        top_tokens, _ = expand(frontier, tokens[: level[0]], parents[: level[0]], depth)  # [F, k]
        tokens[level] = top_tokens[slot, ranks[level]]
    return DraftTree.from_static(tree, tokens)


def grow_dynamic(spec: DynamicTreeSpec, root: torch.Tensor, expand: Expand) -> DraftTree:
    """EAGLE-2's tree: expand the `top_k` best frontier nodes per depth, verify the `num_nodes` best drafted nodes.

    Node scores are cumulative log-probabilities under the drafter. A child never scores above its parent and is
    created after it, so ordering by (score desc, creation order) puts every parent before its children and any
    prefix of that order is a valid, ancestor-closed tree.
    """
    device = root.device
    tokens = root.view(1).clone()  # [n] every drafted node so far
    parents = torch.full((1,), -1, dtype=torch.long, device=device)
    scores = torch.zeros(1, device=device)
    frontier = torch.zeros(1, dtype=torch.long, device=device)  # node ids expanded next
    for depth in range(1, spec.depth + 1):
        top_tokens, top_logp = expand(frontier, tokens, parents, depth)  # [F, k]
        top_tokens, top_logp = top_tokens[:, : spec.top_k], top_logp[:, : spec.top_k]
        child_scores = (scores[frontier, None] + top_logp.float()).flatten()  # [F * k]
        first_child = tokens.numel()
        tokens = torch.cat([tokens, top_tokens.flatten()])
        parents = torch.cat([parents, frontier.repeat_interleave(top_tokens.shape[1])])
        scores = torch.cat([scores, child_scores])
        keep = min(spec.top_k, child_scores.numel())
        frontier = first_child + child_scores.topk(keep).indices.sort().values
    order = _stable_best(scores, spec.num_nodes + 1)  # root first (score 0 is the maximum)
    chosen = order.sort().values  # creation order keeps parents before children
    remap = torch.full_like(parents, -1)
    remap[chosen] = torch.arange(chosen.numel(), device=device)
    new_parents = remap[parents[chosen].clamp(min=0)]
    new_parents[0] = -1
    tree = DraftTree.from_parents(tokens[chosen], new_parents)
    tree.node_ids = chosen
    return tree


def _stable_best(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n best scores, ties broken by the lower index (so parents beat children of equal score)."""
    order = torch.sort(-scores, stable=True).indices
    return order[: min(n, scores.numel())]
