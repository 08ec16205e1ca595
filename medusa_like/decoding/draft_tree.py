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
    grow_dynamic(spec, root, expand)   a `DynamicTreeSpec`, EAGLE-2: at each depth expand the `top_k` best nodes by cumulative
                                       log-probability, then keep the `num_nodes` best drafted nodes

Both trees are ancestor-closed, so any of them is verified exactly as a static tree is: the output stays lossless.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

# expand(frontier [F] node ids, tokens [n], parents [n], depth of the children) -> (tokens [F, k], logp [F, k])
Expand = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [T] long, node 0 = root
    parents: torch.Tensor  # [T] long, -1 for the root
    depth: torch.Tensor  # [T] long
    attention_mask: torch.Tensor  # [T, T] bool
    retrieve: torch.Tensor  # [P, D+1] long, -1 padded
    logp: torch.Tensor | None = None  # [T] float: each node's cumulative log-probability under its drafter (root 0)
    sources: torch.Tensor | None = None  # [T] long: bit i set when source_names[i] proposed the node
    source_names: tuple[str, ...] = ()

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
        """Compile a tree from node tokens [T] and parents [T] (parents[0] = -1, parents[i] < i).

        Trees are small (tens of nodes): each node's path is built from its parent's as a Python list, then every
        buffer is written in one tensor operation.
        """
        num_nodes = tokens.numel()
        parent_list = parents.tolist()
        if parent_list[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parent_list) if i > 0):
            raise ValueError(f"parents must be -1 for the root and point to an earlier node, got {parent_list}")
        paths = [[0]]  # paths[i]: node ids root -> i, so paths[i][d] is i's ancestor at depth d
        for i in range(1, num_nodes):
            paths.append(paths[parent_list[i]] + [i])
        device = tokens.device
        depth = torch.tensor([len(path) - 1 for path in paths], dtype=torch.long, device=device)
        rows = [i for i, path in enumerate(paths) for _ in path]
        cols = [node for path in paths for node in path]
        mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool, device=device)
        mask[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True
        is_parent = set(parent_list[1:])
        leaves = [paths[i] for i in range(num_nodes) if i not in is_parent]
        width = max(len(path) for path in leaves)  # D + 1
        retrieve = torch.tensor([path + [-1] * (width - len(path)) for path in leaves], dtype=torch.long, device=device)
        return cls(tokens, parents, depth, mask, retrieve)

    @classmethod
    def from_static(cls, tree, tokens: torch.Tensor) -> "DraftTree":
        """The tokens [T] of a static tree's nodes, with the static tree's precompiled buffers."""
        return cls(tokens, tree.parents, tree.depth, tree.attention_mask, tree.retrieve)


# ---------------------------------------------------------------------------------------------------------------------
# Growing trees from a drafter


def grow_static(tree, root: torch.Tensor, expand: Expand) -> DraftTree:
    """Fill a static tree of rank paths: node p's token is rank p[-1] of the drafter's top-k after its parent."""
    device = root.device
    tokens = torch.empty(tree.num_nodes, dtype=torch.long, device=device)
    tokens[0] = root
    logp = torch.zeros(tree.num_nodes, device=device)
    parents, ranks = tree.parents, tree.ranks
    for depth in range(1, tree.max_depth + 1):
        level = tree.level(depth)  # [n_d] node ids at this depth
        frontier, slot = parents[level].unique(return_inverse=True)  # [F], [n_d]
        top_tokens, top_logp = expand(frontier, tokens[: level[0]], parents[: level[0]], depth)  # [F, k]
        tokens[level] = top_tokens[slot, ranks[level]]
        logp[level] = logp[parents[level]] + top_logp[slot, ranks[level]].float()
    draft = DraftTree.from_static(tree, tokens)
    draft.logp = logp
    return draft


def grow_dynamic(spec, root: torch.Tensor, expand: Expand) -> DraftTree:
    """EAGLE-2's tree: expand the `top_k` best frontier nodes per depth, verify the `num_nodes` best drafted nodes.

    Node scores are cumulative log-probabilities under the drafter. A child never scores above its parent and is
    created after it, so ordering by (score desc, creation order) puts every parent before its children and any
    prefix of that order is a valid, ancestor-closed tree.
    """
    device = root.device
    # every drafted node so far is [:n] of these buffers: at most top_k children for each of at most top_k nodes
    tokens = torch.empty(spec.drafted_nodes, dtype=torch.long, device=device)  # [N]
    parents = torch.empty(spec.drafted_nodes, dtype=torch.long, device=device)
    scores = torch.empty(spec.drafted_nodes, device=device)
    tokens[:1], parents[0], scores[0], n = root.view(1), -1, 0.0, 1
    frontier = torch.zeros(1, dtype=torch.long, device=device)  # node ids expanded next
    for depth in range(1, spec.depth + 1):
        top_tokens, top_logp = expand(frontier, tokens[:n], parents[:n], depth)  # [F, k]
        top_tokens, top_logp = top_tokens[:, : spec.top_k], top_logp[:, : spec.top_k]
        child_scores = (scores[frontier, None] + top_logp.float()).flatten()  # [F * k]
        first_child, n = n, n + child_scores.numel()
        tokens[first_child:n] = top_tokens.flatten()
        parents[first_child:n] = frontier.repeat_interleave(top_tokens.shape[1])
        scores[first_child:n] = child_scores
        keep = min(spec.top_k, child_scores.numel())
        frontier = first_child + child_scores.topk(keep).indices.sort().values
    tokens, parents, scores = tokens[:n], parents[:n], scores[:n]
    order = _stable_best(scores, spec.num_nodes + 1)  # root first (score 0 is the maximum)
    chosen = order.sort().values  # creation order keeps parents before children
    remap = torch.full_like(parents, -1)
    remap[chosen] = torch.arange(chosen.numel(), device=device)
    new_parents = remap[parents[chosen].clamp(min=0)]
    new_parents[0] = -1
    draft = DraftTree.from_parents(tokens[chosen], new_parents)
    draft.logp = scores[chosen]
    return draft


def _stable_best(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the n best scores, ties broken by the lower index (so parents beat children of equal score)."""
    order = torch.sort(-scores, stable=True).indices
    return order[: min(n, scores.numel())]
