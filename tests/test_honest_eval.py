"""Honest figures from the evaluation: every output compared with transformers' greedy as it ships as well as with
greedy on the same layers; every method run on the same layers and cost model; and a method of this project that
differs from either, whichever method it is, failing `python -m eval.evaluate`.

A lossy method is made the way a bug would make one, by a small wrapper script around the real entry point: the real
method's output with its last token changed. A stock reference that differs is made by giving (g) a copy of the
target whose final norm is negated (its greedy picks the other end of the same logits), so that every method of this
project equals (a) and differs from (g) alone. The decoding loop is exact whatever a drafter proposes, so no honest
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
from hydra.utils import instantiate

from medusa_like.apps import evaluate as app
from medusa_like.evaluation.methods import REFERENCE, SPECULATIVE, STOCK
from medusa_like.evaluation.report import markdown
from medusa_like.evaluation.setup import load_eval_model
from medusa_like.forward import MachineProfile, write_profile
from medusa_like.forward.cost_measure import measure_cost_model
from medusa_like.forward.cpu.few_row_linear import FewRowLinear

from .conftest import check_untouched, compose_config

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it about snow."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
]
SHORT = ("eval.max_new_tokens=6", "eval.sweep.prompts=0", "eval.head_accuracy=false", "drafter.seed_store=0")

# python wrapper.py <method to break, "stock" or "none"> <overrides...>: `python -m eval.evaluate <overrides...>`, with
# the named method's output changed in its last token, or with (g) run (and its margins computed) on a copy of the
# target whose final norm is negated
WRAPPER = """
import runpy
import sys

import torch

from medusa_like.evaluation.methods import METHODS, Method

broken, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
if broken == "stock":
    from medusa_like.forward import PreparedTarget
    from medusa_like.forward.cpu.few_row_linear import with_stock_linears

    real_stock = PreparedTarget.stock

    def negated_stock(self):
        stock = with_stock_linears(real_stock(self))  # a copy sharing every weight, so the norm below is its own
        norm = stock.model.norm  # a weight of its own: the target's, shared with every other method, is untouched
        norm.weight = torch.nn.Parameter(-norm.weight.detach().clone(), requires_grad=False)
        return stock

    PreparedTarget.stock = negated_stock
elif broken != "none":
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
    """What every few-row layer of `target` runs: the fp32 kernel or not, oneDNN's pack from how many rows, its packs."""
    return [
        (name, m.fp32_kernel, m.many_from, sorted(m.packs.packs))
        for name, m in target.named_modules()
        if isinstance(m, FewRowLinear)
    ]


# ---------------------------------------------------------------------------------------------------------------------
# A lossy method of this project fails the entry point


def run_entry_point(tmp_path: Path, broken: str, compiled: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
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
        # `compiled`: as shipped (the compiled step where this machine compiles: (a) is then this project's loop on
        # it, and (g) stock transformers); else the eager step, for the exit status alone
        *([] if compiled else ["target.compile=false"]),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(wrapper), broken, *overrides], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    return done, run_dir


OURS = ["plain_loop", "learned", "lookup", SPECULATIVE]  # a combined drafter's methods, in METHODS' order


def failure_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("not lossless:")]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("broken", "compiled"),
    [("none", False), pytest.param("none", True, marks=pytest.mark.heavy), ("lookup", False), ("stock", False)],
    ids=["none", "none-compiled", "lookup", "stock"],
)
def test_a_method_of_this_project_that_differs_from_a_reference_makes_evaluate_exit_1(tmp_path, broken, compiled):
    """Every output equal to (a) and (g): status 0, nothing on stderr, on the eager step and as shipped (compiled,
    with the shipped compiler options, where this machine compiles). Lookup alone changed: status 1. (g) changed:
    every method of this project still equals (a), yet the run fails on (g) alone, with (g)'s margins in the report
    and one stderr line naming the methods, (g) and the prompts."""
    done, run_dir = run_entry_point(tmp_path, broken, compiled)
    assert done.returncode == (0 if broken == "none" else 1), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["setup"]["step"].startswith("compiled" if compiled else "eager")  # the step the methods ran on
    lossless = report["losslessness"]
    assert lossless["stock"]["compared"]  # fp32 on the CPU: few-row layers, so (g) runs beside (a)
    assert list(lossless["per_method"]) == OURS
    for method, shares in lossless["equality"].items():  # every method against (a) and (g), but each against itself
        assert set(shares) == {REFERENCE, STOCK} - {method}
    if broken == "none":
        assert report["summary"]["lossless"] and lossless["not_lossless"] == [] and lossless["failures"] == []
        assert all(lossless["per_method"][m] == 1.0 for m in OURS)
        assert all(lossless["equality"][m][STOCK] == 1.0 for m in OURS)
        assert failure_lines(done.stderr) == [] and "CAUTION" not in (run_dir / "report.md").read_text()
        return
    assert not report["summary"]["lossless"] and "LOSSLESSNESS FAILED" in (run_dir / "report.md").read_text()
    if broken == "stock":
        # every method of this project equals (a) on every prompt: (g) alone fails the run, for each of them
        assert lossless["fraction"] == 1.0 and all(lossless["per_method"][m] == 1.0 for m in OURS)
        assert lossless["not_lossless"] == OURS and report["summary"]["stock_equality"] == 0.0
        failures = lossless["failures"]
        assert [(f["method"], f["reference"], f["differing_prompts"], f["prompts"]) for f in failures] == [
            (m, STOCK, 3, 3) for m in OURS
        ]
        # (g)'s token is the negated copy's top-1: a positive margin, the one its difference entry records
        against_stock = lossless["differences"][STOCK]
        for f in failures:
            assert f["margins"] == [d["margin"] for d in against_stock if d["method"] == f["method"]]
            assert len(f["margins"]) == 3 and all(m > 0 for m in f["margins"])
        [line] = failure_lines(done.stderr)
        assert f"{', '.join(OURS)} differ from {STOCK} on 3 of 3 prompts each (margins " in line
        assert f"from {REFERENCE} " not in line
        return
    # the speculative method stays lossless: lookup alone's mismatch is what fails the run
    assert lossless["fraction"] == 1.0 and report["summary"]["losslessness"] == 1.0
    assert lossless["not_lossless"] == ["lookup"]
    assert lossless["equality"]["lookup"] == {REFERENCE: 0.0, STOCK: 0.0}
    assert [(f["method"], f["reference"], f["differing_prompts"]) for f in lossless["failures"]] == [
        ("lookup", REFERENCE, 3),
        ("lookup", STOCK, 3),
    ]
    [line] = failure_lines(done.stderr)
    assert f"lookup differs from {REFERENCE} on 3 of 3 prompts (margins " in line
    assert f"lookup differs from {STOCK} on 3 of 3 prompts (margins " in line
    against_stock = lossless["differences"][STOCK]
    assert {d["method"] for d in against_stock} == {"lookup"} and len(against_stock) == 3  # 3 prompts
    records = {(r["question_id"], r["turn"]): r for r in map(json.loads, (run_dir / "prompts.jsonl").open())}
    # each margin, recomputed here: the stock target's logit of (g)'s token minus that of lookup's, at the difference
    cfg = compose_config("eval", tmp_path, "model=tiny_llama", f"data.path={questions_file(tmp_path)}", *SHORT)
    stock_target = check_untouched(instantiate(cfg.model.loader)[0])  # loaded again, untouched: transformers' own
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
# Every method runs the kernels the machine profile chose


@pytest.mark.slow
@pytest.mark.parametrize("profile", [True, False])
def test_every_method_runs_the_same_layers_and_the_cost_model_chosen_before_timing(
    tmp_path, eval_cfg, monkeypatch, profile
):
    """A combined drafter's evaluation, through `evaluate`, watched around every call of every method (warm-up
    included): the target's layers run the kernels they ran before the first method, and lookup alone sizes its trees
    by the combined drafter's cost model, the machine profile's (`target.profile`) or the one settled before timing
    (none). A method that measured a cost model of its own would size later methods' trees by another."""
    overrides = [f"data.path={questions_file(tmp_path)}", *SHORT, f"out_dir={tmp_path / 'run'}"]
    saved = None
    if profile:
        model = load_eval_model(eval_cfg(*overrides))
        saved = measure_cost_model(model.forward, sizes=(1, 2, 4, 8), prefix=8, repeats=1)
        write_profile(MachineProfile(False, model.forward.identity(), saved), tmp_path / "profile.json")
        overrides.append(f"target.profile={tmp_path / 'profile.json'}")
    cfg = eval_cfg(*overrides, "tree=dynamic")
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
    assert seen["kernels"]  # the target runs few-row layers
    calls = seen["calls"]
    assert {"hf_greedy", STOCK, "learned", "lookup", SPECULATIVE} <= {name for name, _, _ in calls}
    assert len(calls) == 4 * len({name for name, _, _ in calls})  # a warm-up and 3 prompts each
    for name, same_kernels, costs in calls:
        assert same_kernels, f"{name} changed the target's layers"
        # lookup alone gets the combined drafter's when it first generates (None before: none of its own)
        assert costs[0] is seen["cost"] and costs[1] in (None, seen["cost"]), f"{name} ran with another cost model"
    assert seen["model"].drafter.parts()["lookup"].cost_model is seen["cost"]
    assert kernels(seen["model"].target) == seen["kernels"]
    if saved is not None:
        assert seen["cost"].verify_ms == pytest.approx(saved.verify_ms, abs=1e-3)


@pytest.mark.slow  # torch.compile of a tiny target, twice (two cache lengths): 20 s of a core
def test_transformers_compiled_greedy_gives_transformers_greedy_tokens_over_two_cache_lengths():
    """(h), transformers' greedy over a static cache sized to the prompt and new tokens rounded up to a bucket, gives
    the tokens of transformers' greedy `generate` on prompts whose caches round to different lengths."""
    from medusa_like.evaluation.methods import hf_compiled_runner

    from .conftest import random_prompts, stock_greedy, tiny_target, untouched_target

    target = tiny_target("llama").eval()
    run = hf_compiled_runner(target, eos=[], pad=None, bucket=16)
    untouched = untouched_target("llama")  # the runner compiles `target`'s forward: the reference is another copy
    for prompt in random_prompts(3, seed=3, min_len=3, max_len=14):  # 3..14 + 8 new tokens: caches of 16 and 32
        tokens, stats = run(prompt, 8)
        assert tokens == stock_greedy(untouched, [prompt], 8)[0] and stats is None
