"""Token trees: compiled buffers, presets, greedy construction and every invalid-tree error."""

import pytest
import torch

from medusa_like.decoding.tree import BudgetedTreeSpec, DynamicTreeSpec, InvalidTreeError, TokenTree, check_drafter
from medusa_like.decoding.tree_files import load_tree, resolve_tree, save_tree
from medusa_like.decoding.tree_presets import PRESETS, chain, expected_acceptance, greedy_tree


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
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3] and tree.ranks.tolist() == [0, 0, 1, 0, 1, 0]
    # sizes, each in one place: verified nodes, drafted nodes, drafter-cache entries (nodes with children, root aside)
    assert (tree.max_nodes, tree.drafted_nodes, tree.cache_entries) == (6, 6, 2)
    # leaves: [1], [0,1], [0,0,0]
    assert sorted(tree.retrieve.tolist()) == sorted([[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]])


def test_path_order_does_not_matter():
    a = TokenTree.from_paths([[0], [1], [0, 0]])
    b = TokenTree.from_paths([[0, 0], [1], [0]])
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.parents, b.parents) and torch.equal(a.ranks, b.ranks)


def test_root_only_tree_is_plain_decoding():
    tree = resolve_tree("none", 4)
    assert tree.num_nodes == 1 and tree.max_depth == 0
    assert tree.retrieve.tolist() == [[0]]


@pytest.mark.parametrize(
    "paths, message",
    [
        ([[0], [0, 0, 0]], "has no parent"),
        ([[0], [0]], "appears twice"),
        ([[0], []], "non-empty"),
        ([[0], [-1]], "negative"),
        ([[0], ["a"]], "not an integer"),
        ("[[0]]", "unknown tree preset"),
    ],
)
def test_invalid_trees_name_the_bad_path(paths, message):
    with pytest.raises(InvalidTreeError, match=message):
        if isinstance(paths, str):
            resolve_tree(paths, 4)
        else:
            TokenTree.from_paths(paths)


def test_presets_have_the_advertised_sizes():
    assert resolve_tree("chain", 4).paths == chain(4)
    assert resolve_tree("small", 4).num_nodes == 16
    assert resolve_tree("medusa", 4).num_nodes == 64
    for name in PRESETS:
        tree = resolve_tree(name, 4)
        assert tree.max_depth <= 4


@pytest.mark.parametrize(
    "spec, message",
    [
        (TokenTree.from_paths(chain(5)), "depth 5 but the drafter drafts at most 4 deep"),
        (TokenTree.from_paths([[0], [5]]), "rank 5 \\(top-6\\) but the drafter proposes at most 3"),
        (DynamicTreeSpec(depth=5, top_k=2, num_nodes=4), "depth 5"),
        (DynamicTreeSpec(depth=2, top_k=4, num_nodes=4), "top-4"),
        (BudgetedTreeSpec(DynamicTreeSpec(depth=2, top_k=4, num_nodes=4), 8, lookup_depth=8), "top-4"),
    ],
)
def test_a_tree_the_drafter_cannot_fill_is_refused_in_one_place(spec, message):
    """Depth against a drafter's heads, ranks against its top-k or vocabulary; a budgeted tree's lookup depth is not
    the drafter's to fill, so only its learned part is checked."""
    with pytest.raises(InvalidTreeError, match=message):
        check_drafter(spec, max_depth=4, max_rank=3)
    check_drafter(BudgetedTreeSpec(None, 8, lookup_depth=16), max_depth=4, max_rank=3)  # lookup only: fits


@pytest.mark.parametrize(
    "spec",
    [
        TokenTree.from_paths([[0], [1], [0, 0]]),
        DynamicTreeSpec(depth=3, top_k=2, num_nodes=5),
        BudgetedTreeSpec(DynamicTreeSpec(depth=2, top_k=4, num_nodes=4), 12, lookup_depth=6),
        BudgetedTreeSpec(None, 6, lookup_depth=3),
    ],
)
def test_every_tree_spec_answers_the_same_questions_and_round_trips(spec, tmp_path):
    again = load_tree(save_tree(spec, tmp_path / "tree.json", note="meta is kept beside the tree"))
    assert again.to_json() == spec.to_json()
    assert (again.max_depth, again.max_nodes, again.top_k) == (spec.max_depth, spec.max_nodes, spec.top_k)
    assert spec.max_nodes >= 1 and spec.drafted_nodes >= 1 and spec.cache_entries >= 0


def test_greedy_tree_is_best_first_and_valid():
    acc = [[0.6, 0.25, 0.1], [0.5, 0.1, 0.05]]
    # path probabilities: [0] .6, [0,0] .3, [1] .25, [1,0] .125, [2] .1, [0,1] .06, ...
    paths = greedy_tree(acc, 4)
    assert paths == [(0,), (0, 0), (1,), (1, 0)]
    TokenTree.from_paths(paths)  # valid
    assert expected_acceptance(paths, acc) == pytest.approx(0.6 + 0.3 + 0.25 + 0.125)
    assert len(greedy_tree(acc, 100)) == 3 + 3 * 3  # the whole tree when the budget exceeds it


def test_save_and_load_tree(tmp_path):
    path = save_tree(TokenTree.from_paths([[0], [1], [0, 0]]), tmp_path / "tree.json", budget=3)
    assert load_tree(path).paths == [(0,), (1,), (0, 0)]
    assert resolve_tree(str(path), 2).num_nodes == 4
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidTreeError, match="not valid JSON"):
        load_tree(bad)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b"[[0], \xe9]")
    with pytest.raises(InvalidTreeError, match="latin.json.*not UTF-8"):
        load_tree(latin)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tree(tmp_path / "missing.json")


def test_a_tree_naming_a_directory_or_another_file_says_so(tmp_path):
    """`tree=runs/x` (the tree search's run directory, not its tree file) is not called an unknown preset."""
    with pytest.raises(InvalidTreeError, match="is a directory: expected a tree JSON file"):
        resolve_tree(str(tmp_path), 4)
    (tmp_path / "tree.txt").write_text("[[0]]")
    with pytest.raises(InvalidTreeError, match="is not a .json file"):
        resolve_tree(str(tmp_path / "tree.txt"), 4)
