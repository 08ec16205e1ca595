"""Honest figures from the evaluation: every output compared with transformers' greedy as it ships as well as with
greedy on the same layers; every method run on the kernels the tree file chose; and a lossy method of this project,
whichever it is, failing `python -m eval.evaluate`.

A lossy method is made the way a bug would make one, by a small wrapper script around the real entry point: the real
method's output with its last token changed. The decoding loop is exact whatever a drafter proposes, so no honest
config makes one of this project's methods lossy; everything else (timing, comparisons, margins, report, exit status)
is the evaluation's own.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from medusa_like.apps import evaluate as app
from medusa_like.decoding.tree_files import save_tree
from medusa_like.evaluation.methods import REFERENCE, SPECULATIVE, STOCK
from medusa_like.evaluation.report import markdown
from medusa_like.evaluation.setup import load_eval_model
from medusa_like.forward.cost_measure import measure_cost_model
from medusa_like.forward.cpu.few_row_linear import FewRowLinear, with_stock_linears

from .conftest import compose_config

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it about snow."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
]
SHORT = ("eval.max_new_tokens=6", "eval.sweep.prompts=0", "eval.head_accuracy=false", "drafter.seed_store=0")

# python wrapper.py <method to break or "none"> <overrides...>: `python -m eval.evaluate <overrides...>`, with the
# named method's output changed in its last token
WRAPPER = """
import runpy
import sys

from medusa_like.evaluation.methods import METHODS, Method

broken, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
if broken != "none":
    method = METHODS[broken]

    def make(context):
        run = method.make(context)
        vocab = context.model.target.config.vocab_size

        def run_lossy(ids, max_new_tokens):
            tokens, stats = run(ids, max_new_tokens)
            return [*tokens[:-1], (tokens[-1] + 1) % vocab] if tokens else [0], stats

        return run_lossy

    METHODS[broken] = Method(method.label, method.description, make, method.applies)
runpy.run_module("eval.evaluate", run_name="__main__")
"""


def questions_file(tmp_path: Path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return path


def kernels(target) -> list[tuple]:
    """What every few-row layer of `target` runs: its row plan (a kernel per row count) and its prefill kernel."""
    return [(name, m.plan, m.prefill) for name, m in target.named_modules() if isinstance(m, FewRowLinear)]


# ---------------------------------------------------------------------------------------------------------------------
# A lossy method of this project fails the entry point


def run_entry_point(tmp_path: Path, broken: str) -> tuple[subprocess.CompletedProcess, Path]:
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    run_dir = tmp_path / "run"
    overrides = [
        "model=tiny_llama",  # a combined drafter (the default): zero-initialised heads and lookup
        f"data.path={questions_file(tmp_path)}",
        "tree=chain",
        "eval.warmup=false",
        "eval.threads=1",
        *SHORT,
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(wrapper), broken, *overrides], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    return done, run_dir


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["none", "lookup"])
def test_a_lossy_method_of_this_project_makes_evaluate_exit_1(tmp_path, broken):
    done, run_dir = run_entry_point(tmp_path, broken)
    assert done.returncode == (0 if broken == "none" else 1), done.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    lossless = report["losslessness"]
    assert lossless["stock"]["compared"]  # fp32 on the CPU: few-row layers, so (g) runs beside (a)
    ours = {"plain_loop", "learned", "lookup", SPECULATIVE}
    assert set(lossless["per_method"]) == ours
    for method, shares in lossless["equality"].items():  # every method against (a) and (g), but each against itself
        assert set(shares) == {REFERENCE, STOCK} - {method}
    if broken == "none":
        assert report["summary"]["lossless"] and lossless["not_lossless"] == []
        assert all(lossless["per_method"][m] == 1.0 for m in ours)
        return
    # the speculative method stays lossless: lookup alone's mismatch is what fails the run
    assert lossless["fraction"] == 1.0 and report["summary"]["losslessness"] == 1.0
    assert not report["summary"]["lossless"] and lossless["not_lossless"] == ["lookup"]
    assert lossless["equality"]["lookup"] == {REFERENCE: 0.0, STOCK: 0.0}
    assert "LOSSLESSNESS FAILED" in (run_dir / "report.md").read_text()
    against_stock = lossless["differences"][STOCK]
    assert {d["method"] for d in against_stock} == {"lookup"} and len(against_stock) == 3  # 3 prompts
    records = {(r["question_id"], r["turn"]): r for r in map(json.loads, (run_dir / "prompts.jsonl").open())}
    # each margin, recomputed here: the stock target's logit of (g)'s token minus that of lookup's, at the difference
    cfg = compose_config("eval", tmp_path, "model=tiny_llama", f"data.path={questions_file(tmp_path)}", *SHORT)
    stock_target = with_stock_linears(load_eval_model(cfg).target)
    for d in against_stock:
        record, i = records[d["question_id"], d["turn"]], d["first_divergence"]
        stock, lossy = record[STOCK]["tokens"], record["lookup"]["tokens"]
        assert stock[:i] == lossy[:i] and stock[i] != lossy[i] == d["method_token"]
        with torch.inference_mode():
            logits = stock_target(torch.tensor([record["prompt_ids"] + stock[:i]])).logits[0, -1]
        assert d["margin"] == pytest.approx(float(logits[stock[i]] - logits[lossy[i]]), abs=1e-4)
        assert d["margin"] > 0  # (g)'s token is the stock target's top-1


# ---------------------------------------------------------------------------------------------------------------------
# Stock greedy not run: said so


@pytest.mark.slow
def test_a_report_without_stock_greedy_says_so(tmp_path, eval_cfg):
    """Layers left as nn.Linear (as on a GPU, or in bf16 without few-row layers): (a) is transformers' greedy as it
    ships, (g) does not run, and the report says why."""
    cfg = eval_cfg(
        f"data.path={questions_file(tmp_path)}",
        "target.tuned_layers=false",
        "tree=chain",
        "eval.warmup=false",
        *SHORT,
        f"out_dir={tmp_path / 'run'}",
    )
    report = app.evaluate(cfg)
    stock = report["losslessness"]["stock"]
    assert not stock["compared"] and "nn.Linear" in stock["note"]
    assert STOCK not in report["speed"]["median_tokens_per_second"]
    assert report["summary"]["stock_equality"] is None and report["summary"]["lossless"]
    assert all(set(shares) == {REFERENCE} - {m} for m, shares in report["losslessness"]["equality"].items())
    assert stock["note"] in markdown(report)


# ---------------------------------------------------------------------------------------------------------------------
# Every method runs the kernels the tree file chose


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["file", "preset"])
def test_every_method_runs_the_kernels_the_cost_model_chose(tmp_path, eval_cfg, monkeypatch, tree):
    """A combined drafter's evaluation, through `evaluate`, watched around every call of every method (warm-up
    included): the target's kernels are the ones set before the first method ran, and lookup alone sizes its trees by
    the combined drafter's cost model, the tree file's (`file`) or the one settled before timing (`preset`: a tree
    with no cost model). A method that measured a cost model of its own would set other kernels for every later one."""
    overrides = [f"data.path={questions_file(tmp_path)}", *SHORT, f"out_dir={tmp_path / 'run'}"]
    saved = None
    if tree == "file":
        model = load_eval_model(eval_cfg(*overrides))
        saved = measure_cost_model(model.forward, sizes=(1, 2, 4, 8), prefix=8, repeats=1)
        save_tree(model.resolve_tree("dynamic"), tmp_path / "tree.json", cost_model=saved.to_json())
    cfg = eval_cfg(*overrides, f"tree={tmp_path / 'tree.json'}" if saved else "tree=dynamic")
    real_make_runners = app.make_runners
    seen = {}

    def watched_runners(model, *args, **kwargs):
        runners = real_make_runners(model, *args, **kwargs)
        seen.update(model=model, kernels=kernels(model.target), cost=model.drafter.cost_model, calls=[])

        def watch(name, run):
            def wrapped(ids, max_new_tokens):
                before = kernels(model.target)
                out = run(ids, max_new_tokens)
                costs = (model.drafter.cost_model, model.drafter.parts()["lookup"].cost_model)
                seen["calls"].append((name, before == seen["kernels"] == kernels(model.target), costs))
                return out

            return wrapped

        return {name: watch(name, run) for name, run in runners.items()}

    monkeypatch.setattr(app, "make_runners", watched_runners)
    report = app.evaluate(cfg)
    assert report["summary"]["lossless"]
    assert any(plan for _, plan, _ in seen["kernels"])  # the target runs few-row layers with row plans
    calls = seen["calls"]
    assert {"hf_greedy", STOCK, "learned", "lookup", SPECULATIVE} <= {name for name, _, _ in calls}
    assert len(calls) == 4 * len({name for name, _, _ in calls})  # a warm-up and 3 prompts each
    for name, same_kernels, costs in calls:
        assert same_kernels, f"{name} changed the target's kernels"
        assert all(cost is seen["cost"] for cost in costs), f"{name} ran with another cost model"
    assert kernels(seen["model"].target) == seen["kernels"]
    if saved is not None:
        assert seen["cost"].verify_ms == pytest.approx(saved.verify_ms, abs=1e-3)
