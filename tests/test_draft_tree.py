"""Per-step draft trees: compilation from parents, static growth, EAGLE-2 dynamic growth."""

import pytest
import torch

from medusa_like.decoding.draft_tree import DraftTree, grow_dynamic, grow_static
from medusa_like.decoding.tree import DynamicTreeSpec, TokenTree
from medusa_like.decoding.tree_files import resolve_tree


def random_expand(vocab: int = 50, seed: int = 0):
    """An expand function whose children are a deterministic function of (parent token, depth)."""

    def expand(frontier, tokens, parents, depth):
        rows = []
        for node in frontier.tolist():
            g = torch.Generator().manual_seed(seed * 1000 + int(tokens[node]) * 10 + depth)
            rows.append(torch.randn(vocab, generator=g).log_softmax(-1))
        logp = torch.stack(rows)  # [F, V]
        top = logp.topk(8, dim=-1)
        return top.indices, top.values

    return expand


@pytest.mark.parametrize("name", ["chain", "small", "medusa"])
def test_from_parents_matches_static_compilation(name):
    static = resolve_tree(name, 4)
    tokens = torch.arange(static.num_nodes)
    compiled = DraftTree.from_parents(tokens, static.parents)
    assert torch.equal(compiled.attention_mask, static.attention_mask)
    assert torch.equal(compiled.depth, static.depth)
    assert sorted(map(tuple, compiled.retrieve.tolist())) == sorted(map(tuple, static.retrieve.tolist()))
    assert compiled.children == DraftTree.from_static(static, tokens).children


def test_from_parents_refuses_a_parent_after_its_child():
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree.from_parents(torch.arange(3), torch.tensor([-1, 2, 0]))


@pytest.mark.parametrize("name", ["chain", "small", "medusa"])
def test_grow_static_takes_the_ranked_child_of_each_parent(name):
    static = resolve_tree(name, 4)
    expand = random_expand()
    tree = grow_static(static, torch.tensor(7), expand)
    assert tree.tokens[0] == 7
    for node in range(1, static.num_nodes):
        parent = int(static.parents[node])
        top_tokens, _ = expand(torch.tensor([parent]), tree.tokens, static.parents, int(static.depth[node]))
        assert tree.tokens[node] == top_tokens[0, static.ranks[node]]


@pytest.mark.parametrize("depth,top_k,num_nodes", [(1, 3, 2), (3, 2, 5), (4, 4, 16), (5, 8, 40), (6, 10, 60)])
def test_grow_dynamic_keeps_the_best_ancestor_closed_nodes(depth, top_k, num_nodes):
    spec = DynamicTreeSpec(depth, top_k, num_nodes)
    expand = random_expand(seed=depth)
    tree = grow_dynamic(spec, torch.tensor(3), expand)
    drafted = min(num_nodes, top_k + (depth - 1) * top_k * top_k)
    assert tree.num_nodes == drafted + 1
    assert tree.max_depth <= depth
    parents = tree.parents.tolist()
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    # each node's token is one of its parent's top-k children, and siblings are distinct
    for node in range(1, tree.num_nodes):
        parent = parents[node]
        top_tokens, _ = expand(torch.tensor([parent]), tree.tokens, tree.parents, int(tree.depth[node]))
        assert tree.tokens[node] in top_tokens[0, :top_k].tolist()
    for kids in tree.children:
        assert len({int(tree.tokens[k]) for k in kids}) == len(kids)


def test_grow_dynamic_prefers_higher_cumulative_probability():
    """A confident chain beats many unlikely siblings: the kept nodes are the highest-scoring ones."""

    def expand(frontier, tokens, parents, depth):
        logp = torch.log(torch.tensor([0.9, 0.05, 0.03, 0.02]))
        return torch.arange(4).repeat(frontier.numel(), 1) + 10 * depth, logp.repeat(frontier.numel(), 1)

    tree = grow_dynamic(DynamicTreeSpec(depth=4, top_k=4, num_nodes=4), torch.tensor(0), expand)
    assert tree.tokens.tolist() == [0, 10, 20, 30, 40]  # the chain of 0.9s: 0.9, 0.81, 0.73, 0.66 > 0.05
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]


def test_dynamic_spec_refuses_bad_values():
    with pytest.raises(ValueError, match="top_k"):
        DynamicTreeSpec(depth=3, top_k=0, num_nodes=4)
    with pytest.raises(ValueError, match="num_nodes"):
        DynamicTreeSpec(depth=3, top_k=2, num_nodes=2.5)


def test_static_tree_parents_and_ranks():
    tree = TokenTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.ranks.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert tree.level(2).tolist() == [3, 4, 5]
