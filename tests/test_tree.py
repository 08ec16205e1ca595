"""Token trees: compiled buffers, presets, greedy construction and every invalid-tree error."""

import pytest
import torch

from medusa_like.decoding.tree import (
    PRESETS,
    InvalidTreeError,
    TokenTree,
    chain,
    expected_acceptance,
    greedy_tree,
    load_tree,
    resolve_tree,
    save_tree,
)


def test_compiled_buffers_of_a_small_tree():
    tree = TokenTree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    # nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [0,0,0]
    assert tree.paths == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert tree.top_k == 2 and tree.max_depth == 3
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 1, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.attention_mask, expected_mask)
    # flat index into [K, top_k] proposals: (depth - 1) * top_k + rank
    assert tree.candidate_index.tolist() == [0, 1, 2, 3, 4]
    # leaves: [1], [0,1], [0,0,0]
    assert sorted(tree.retrieve.tolist()) == sorted([[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]])


def test_path_order_does_not_matter():
    a = TokenTree.from_paths([[0], [1], [0, 0]])
    b = TokenTree.from_paths([[0, 0], [1], [0]])
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.candidate_index, b.candidate_index)


def test_root_only_tree_is_plain_decoding():
    tree = resolve_tree("none", num_heads=4)
    assert tree.num_nodes == 1 and tree.max_depth == 0
    assert tree.retrieve.tolist() == [[0]]


@pytest.mark.parametrize(
    "paths, message",
    [
        ([[0], [0, 0, 0]], "has no parent"),
        ([[0], [0]], "appears twice"),
        ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]], "only 4 heads"),
        ([[0], [5]], "top_k is 3"),
        ([[0], []], "non-empty"),
        ([[0], [-1]], "negative"),
        ([[0], ["a"]], "not an integer"),
        ("[[0]]", "unknown tree preset"),
    ],
)
def test_invalid_trees_name_the_bad_path(paths, message):
    with pytest.raises(InvalidTreeError, match=message):
        if isinstance(paths, str):
            resolve_tree(paths, num_heads=4)
        else:
            TokenTree.from_paths(paths, num_heads=4, top_k=3)


def test_presets_have_the_advertised_sizes():
    assert resolve_tree("chain", 4).paths == chain(4)
    assert resolve_tree("small", 4).num_nodes == 16
    assert resolve_tree("medusa", 4).num_nodes == 64
    for name in PRESETS:
        tree = resolve_tree(name, 4)
        assert tree.max_depth <= 4


def test_tree_deeper_than_heads_is_refused():
    with pytest.raises(InvalidTreeError, match="only 2 heads"):
        resolve_tree(TokenTree.from_paths(chain(3)), num_heads=2)


def test_greedy_tree_is_best_first_and_valid():
    acc = [[0.6, 0.25, 0.1], [0.5, 0.1, 0.05]]
    # path probabilities: [0] .6, [0,0] .3, [1] .25, [1,0] .125, [2] .1, [0,1] .06, ...
    paths = greedy_tree(acc, 4)
    assert paths == [(0,), (0, 0), (1,), (1, 0)]
    TokenTree.from_paths(paths)  # valid
    assert expected_acceptance(paths, acc) == pytest.approx(0.6 + 0.3 + 0.25 + 0.125)
    assert len(greedy_tree(acc, 100)) == 3 + 3 * 3  # the whole tree when the budget exceeds it


def test_save_and_load_tree(tmp_path):
    path = save_tree([[0], [1], [0, 0]], tmp_path / "tree.json", budget=3)
    assert load_tree(path) == [(0,), (1,), (0, 0)]
    assert resolve_tree(str(path), num_heads=2).num_nodes == 4
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidTreeError, match="not valid JSON"):
        load_tree(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tree(tmp_path / "missing.json")
