"""Tree search: best trees per budget on synthetic accuracies (worked out by hand and by brute force), timing rows,
head accuracy on a tiny target, and the tree-search app saving a tree that the evaluation then uses."""

import itertools
import json

import pytest
import torch

from medusa_like.decoding.tree_files import load_tree
from medusa_like.decoding.tree_presets import expected_acceptance
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.evaluation.tree_choice import (
    depth_rank_counts,
    depth_topk_accuracy,
    fastest,
    predicted_tau,
    time_trees,
    trees_for_budgets,
)
from medusa_like.forward import read_profile
from medusa_like.forward.cost_measure import SIZES
from medusa_like.model import MedusaLikeModel
from medusa_like.tiny import tiny_chat_target

from .conftest import flat_cost, tiny_target

# head 1: rank 0 right 60%, rank 1 20%, rank 2 15%; head 2: rank 0 50%, rank 1 20%
TOPK = [[0.6, 0.8, 0.95], [0.5, 0.7, 0.7]]
# node probabilities (product along the path):
#   (0) .6   (1) .2   (2) .15   (0,0) .3   (0,1) .12   (1,0) .1   (2,0) .075   (1,1) .04   (2,1) .03
BY_HAND = {
    0: [],
    1: [(0,)],
    2: [(0,), (0, 0)],
    3: [(0,), (0, 0), (1,)],
    4: [(0,), (0, 0), (1,), (2,)],
    5: [(0,), (0, 0), (1,), (2,), (0, 1)],
    6: [(0,), (0, 0), (1,), (2,), (0, 1), (1, 0)],
}
EXPECTED = {0: 0.0, 1: 0.6, 2: 0.9, 3: 1.1, 4: 1.25, 5: 1.37, 6: 1.47}


def all_trees(num_nodes: int):
    """Every valid tree (parents present) of num_nodes nodes over 2 heads x 3 ranks."""
    nodes = [(r,) for r in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    for subset in itertools.combinations(nodes, num_nodes):
        if all(len(p) == 1 or p[:1] in subset for p in subset):
            yield list(subset)


@pytest.mark.parametrize("budget", sorted(BY_HAND))
def test_best_trees_by_hand(budget):
    tree = trees_for_budgets(TOPK, [budget])[budget]
    assert sorted(tree) == sorted(BY_HAND[budget])
    ranks = [[0.6, 0.2, 0.15], [0.5, 0.2, 0.0]]
    assert expected_acceptance(tree, ranks) == pytest.approx(EXPECTED[budget])
    assert predicted_tau(tree, TOPK) == pytest.approx(1 + EXPECTED[budget])


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5])
def test_greedy_tree_is_optimal(budget):
    ranks = [[0.6, 0.2, 0.15], [0.5, 0.2, 0.0]]
    best = max(expected_acceptance(t, ranks) for t in all_trees(budget))
    assert expected_acceptance(trees_for_budgets(TOPK, [budget])[budget], ranks) == pytest.approx(best)


def test_perfect_first_choice_gives_a_chain():
    topk = [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    assert trees_for_budgets(topk, [3])[3] == [(0,), (0, 0), (0, 0, 0)]


def test_bad_budget():
    with pytest.raises(ValueError, match="budgets are numbers of candidate nodes >= 0, got -1"):
        trees_for_budgets(TOPK, [-1])


def test_fastest_prefers_speed_then_smaller_trees():
    rows = [
        {"budget": 4, "nodes": 5, "tokens_per_second": 10.0},
        {"budget": 8, "nodes": 9, "tokens_per_second": 12.0},
        {"budget": 16, "nodes": 17, "tokens_per_second": 12.0},
    ]
    assert fastest(rows)["budget"] == 8
    with pytest.raises(ValueError, match="no timed budgets"):
        fastest([])


@pytest.fixture(scope="module")
def tiny_model():
    target, tokenizer = tiny_chat_target(
        "llama", hidden_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    return MedusaLikeModel.from_pretrained(target, drafter="medusa", tokenizer=tokenizer, num_heads=2)


@pytest.mark.slow
def test_depth_rank_counts_positions(tiny_model):
    # a 5-token prompt + 4 answer tokens (L = 9): head 1 sees t = 4..6 (t + 2 <= 8), head 2 sees t = 4..5
    seq = torch.randint(0, 1000, (1, 9))
    counts = depth_rank_counts(tiny_model, seq, prompt_len=5, k_max=3)
    assert [c[-1] for c in counts] == [3, 2]
    topk = depth_topk_accuracy(tiny_model, [(seq, 5)], k_max=3)
    assert len(topk) == 2 and all(len(t) == 3 for t in topk)


def test_time_trees_rows(tiny_model):
    prompts = [tiny_model.chat_ids([{"role": "user", "content": text}]) for text in ("hi", "hello there")]
    trees = {0: [], 2: [(0,), (0, 0)]}
    rows = time_trees(tiny_model, prompts, trees, max_new_tokens=5)
    by_budget = {r["budget"]: r for r in rows}
    assert by_budget[0]["tau"] == 1.0 and by_budget[0]["nodes"] == 1
    assert by_budget[2]["nodes"] == 3 and by_budget[2]["depth"] == 2
    for r in rows:  # the speed the search ranks by: the geometric mean of the prompts' own
        first, second = r["tokens_per_second_per_prompt"]
        assert r["tokens_per_second"] == pytest.approx((first * second) ** 0.5)


def test_each_timed_tree_learns_in_a_session_of_its_own(monkeypatch):
    """A lookup drafter learns across generations (its calibration). Timed together, each tree learns from its own
    steps in a session state of its own: two trees decode with two states, neither the model's, each of which learned
    from the drafts it saw accepted, while the model's state learns nothing from the search."""
    used = []  # the session state each generation's proposer is made with
    make_proposer = LookupDrafter.proposer

    def recording_proposer(self, target):
        used.append(self.state)
        return make_proposer(self, target)

    monkeypatch.setattr(LookupDrafter, "proposer", recording_proposer)
    target = tiny_target("llama")
    model = MedusaLikeModel(target, None, LookupDrafter(), backend="sdpa")
    model.drafter.use_cost_model(flat_cost(target, per_node_ms=0.5))
    prompts = [torch.tensor([[5, 6, 7, 8, 9] * 4]), torch.tensor([[11, 12, 13] * 5])]  # repeats: lookup drafts
    trees = {n: {"budgeted": {"num_nodes": n, "lookup_depth": 4, "learned": None}} for n in (4, 12)}
    rows = time_trees(model, prompts, trees, max_new_tokens=24)
    assert all(r["tau"] > 1 for r in rows)  # drafts accepted: each tree's calibration learned from them
    shared = model.drafter.state
    states = {id(state): state for state in used}
    assert len(states) == len(trees) and id(shared) not in states
    assert all(state.calibration.trials for state in states.values())
    assert shared.calibration.trials == {} and shared.steps == {} and shared.learned_ms is None


@pytest.mark.slow
def test_tree_search_app_saves_a_tree_eval_uses(tmp_path, eval_cfg):
    from eval.evaluate import evaluate
    from eval.tree_search import tree_search

    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"Say {i} words."]}) for i in range(2))
    )
    tree_path = tmp_path / "tree.json"
    common = ["eval.max_new_tokens=6", "drafter.mode=learned"]  # zero-init heads: static trees
    cfg = eval_cfg(
        *common,
        "tree_search.calibration.source=jsonl",
        f"tree_search.calibration.path={questions}",
        "tree_search.budgets=[1,3]",
        "tree_search.timing_prompts=1",
        f"tree_search.out={tree_path}",
        out_dir=tmp_path / "search",
    )
    result = tree_search(cfg)
    assert result["label"] in (1, 3)
    assert {r["budget"] for r in result["timings"]} == {1, 3}
    saved = json.loads(tree_path.read_text())
    assert saved["budget"] == result["label"] and len(saved["head_topk_accuracy"]) == 4
    assert len(load_tree(tree_path).paths) == result["label"]

    cfg = eval_cfg(
        *common,
        "data.source=jsonl",
        f"data.path={questions}",
        f"tree={tree_path}",
        "eval.sweep.prompts=0",
        out_dir=tmp_path / "run",
    )
    report = evaluate(cfg)
    assert report["setup"]["tree"]["nodes"] == result["label"] + 1
    assert report["summary"]["losslessness"] == 1.0


@pytest.mark.slow
def test_tree_search_of_a_combined_drafter_writes_a_tree_a_profile_and_the_learned_tree(tmp_path, eval_cfg):
    """drafter.mode=combined: budgeted trees are timed; the winner is saved as a tree file that holds the tree alone,
    this machine's cost model and fastest prompt_lookup_num_tokens as a machine profile beside it, and the learned
    drafter's own fastest tree alone as a tree file of its own; the evaluation is handed all three."""
    from eval.evaluate import evaluate
    from eval.tree_search import tree_search

    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"Say {i} words."]}) for i in range(2))
    )
    files = {"out": tmp_path / "tree.json", "profile_out": tmp_path / "profile.json"}
    result = tree_search(
        eval_cfg(
            "eval.max_new_tokens=6",
            "tree_search.calibration.source=jsonl",
            f"tree_search.calibration.path={questions}",
            "tree_search.budgeted.learned=[[1,2,2]]",
            "tree_search.budgeted.num_nodes=[2,4]",
            "tree_search.budgets=[1,3]",  # the learned drafter alone: Medusa heads, static trees of these budgets
            "tree_search.prompt_lookup=[2,3]",
            "tree_search.timing_prompts=1",
            *(f"tree_search.{key}={path}" for key, path in files.items()),
            out_dir=tmp_path / "search",
        )
    )
    assert result["kind"] == "budgeted" and {r["budget"] for r in result["timings"]} == {
        "d1k2n2+lookup8n2",
        "d1k2n2+lookup8n4",
    }
    saved = json.loads(files["out"].read_text())
    assert saved["budgeted"]["num_nodes"] in (2, 4) and not set(saved) & {"cost_model", "prompt_lookup_num_tokens"}
    profile = read_profile(files["profile_out"])
    assert profile.prompt_lookup_num_tokens in (2, 3) and profile.compile is False  # the tests' target.compile
    assert profile.cost_model.nodes == list(SIZES) and len(profile.cost_model.verify_ms) == len(SIZES)
    # the learned drafter's own tree, timed alone: the fastest of its budgets, in the run directory by default
    learned = tmp_path / "search" / "learned_tree.json"
    assert result["learned_tree"] == str(learned) and {
        r["budget"] for r in json.loads(learned.read_text())["timings"]
    } == {1, 3}
    assert len(load_tree(learned).paths) == result["learned_alone"]["label"]
    report = evaluate(
        eval_cfg(
            "eval.max_new_tokens=6",
            "data.source=jsonl",
            f"data.path={questions}",
            f"tree={files['out']}",
            f"target.profile={files['profile_out']}",
            f"learned_tree={learned}",
            out_dir=tmp_path / "run",
        )
    )
    assert report["setup"]["prompt_lookup_num_tokens"] == profile.prompt_lookup_num_tokens
    assert report["setup"]["profile"] == {"path": profile.path, "sha256": profile.sha256}
    assert report["setup"]["tree"]["learned_alone"]["paths"] == json.loads(learned.read_text())["paths"]
    assert report["summary"]["losslessness"] == 1.0


@pytest.mark.slow
def test_a_block_drafter_is_searched_and_evaluated_through_the_registry_alone(tmp_path, eval_cfg):
    """A block drafter's directory, searched alone (its trees are dynamic: its kind's answer) and merged with lookup
    (budgeted trees), then evaluated with what the search wrote: every method lossless, the drafter's kind and
    parameter count in the report."""
    from eval.evaluate import evaluate
    from eval.tree_search import tree_search
    from medusa_like.data.prepare import load_model
    from medusa_like.drafters.block import fresh_block
    from medusa_like.formats import save_drafter

    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "\n".join(json.dumps({"question_id": i, "category": "c", "turns": [f"Say {i} words."]}) for i in range(2))
    )
    target, _ = load_model(eval_cfg().model)
    drafter = save_drafter(fresh_block(target, block_size=4), tmp_path / "block", target, "tiny")
    files = {"out": tmp_path / "tree.json", "profile_out": tmp_path / "profile.json"}
    common = ["eval.max_new_tokens=6", f"drafter.path={drafter}"]
    result = tree_search(
        eval_cfg(
            *common,
            "tree_search.calibration.source=jsonl",
            f"tree_search.calibration.path={questions}",
            "tree_search.budgeted.learned=[[3,1,3]]",
            "tree_search.budgeted.num_nodes=[3]",
            "tree_search.dynamic=[[2,1,2],[3,2,4]]",  # the drafter alone: dynamic trees, its kind says
            "tree_search.prompt_lookup=[2]",
            "tree_search.timing_prompts=1",
            *(f"tree_search.{key}={path}" for key, path in files.items()),
            out_dir=tmp_path / "search",
        )
    )
    assert result["kind"] == "budgeted" and result["learned_alone"]["kind"] == "dynamic"
    report = evaluate(
        eval_cfg(
            *common,
            "data.source=jsonl",
            f"data.path={questions}",
            f"tree={files['out']}",
            f"target.profile={files['profile_out']}",
            f"learned_tree={tmp_path / 'search' / 'learned_tree.json'}",
            "eval.sweep.prompts=0",
            out_dir=tmp_path / "run",
        )
    )
    assert report["setup"]["drafter_kind"] == "combined" and report["setup"]["drafter_parameters"] > 0
    assert report["summary"]["losslessness"] == 1.0
