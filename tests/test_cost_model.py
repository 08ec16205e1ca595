"""Cost models as validated data: every bad field refused with its name, another setup's refused, provenance recorded,
measured once per machine and cached on disk (a corrupt or foreign cache measured again), a quick first estimate on
first use and a full one on request, implausible measurements repeated or fallen back on (a scripted timer, the
decisions real), a machine profile's cost model used by the Python API and the evaluation alike (a tree file's never),
decoding lossless."""

import hashlib
import json
import logging
import math
import platform
import re
from pathlib import Path

import pytest
import torch

from medusa_like.decoding.cost_model import (
    IDENTITY,
    CostModel,
    CostModelError,
    CostModelMismatchError,
    InvalidCostModelError,
)
from medusa_like.decoding.tree import BudgetedTreeSpec
from medusa_like.decoding.tree_files import save_tree
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.evaluation.report import markdown
from medusa_like.forward import MachineProfile, ProfileMismatchError, prepare_target, read_profile, write_profile
from medusa_like.forward.cost_cache import KERNELS, cache_key, cache_path
from medusa_like.forward.cost_measure import QUICK_SIZES, measure_cost_model
from medusa_like.forward.cpu.few_row_linear import FewRowLinear, kernel_record
from medusa_like.forward.cpu.machine import machine_identity
from medusa_like.forward.profile import InvalidProfileError
from medusa_like.io import user_cache_dir
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import DEFAULT_TARGET

from .conftest import random_prompts, stock_greedy, tiny_target, untouched_target


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A cache directory without cost models for this test, as a fresh machine has (the default target,
    whose tokenizer the evaluation's tiny targets use, linked in if converted already)."""
    path = tmp_path / "cache"
    path.mkdir()
    if (user_cache_dir() / DEFAULT_TARGET).is_dir():
        (path / DEFAULT_TARGET).symlink_to((user_cache_dir() / DEFAULT_TARGET).resolve())
    monkeypatch.setenv("MEDUSA_LIKE_CACHE_DIR", str(path))
    return path


def cost_json(target, **changes) -> dict:
    """A cost model of `target`'s eager step (its layers this machine's) as a file holds it, with `changes`."""
    nodes = [1, 2, 4, 8, 16]
    prepared = prepare_target(target)
    kernels = kernel_record(target)
    cost = CostModel(nodes, [10.0 + 0.25 * n for n in nodes], **prepared.identity(), kernels=kernels)
    return cost.to_json() | changes


def lookup_model(target=None) -> MedusaLikeModel:
    target = target if target is not None else tiny_target("llama")
    return MedusaLikeModel(target, None, LookupDrafter(), backend="sdpa")


def assert_lossless(model: MedusaLikeModel, tree="dynamic", prompts: int = 2) -> None:
    """`model` (whose target is `tiny_target("llama")`, as every one here) decodes transformers' greedy tokens of an
    untouched copy of its target."""
    ids = random_prompts(prompts, seed=7, min_len=6, max_len=20)
    for prompt, expected in zip(ids, stock_greedy(untouched_target("llama"), ids, 16), strict=True):
        out = model.generate(prompt, max_new_tokens=16, tree=tree, eos_token_id=[], remember=False)
        assert out.new_tokens.tolist() == expected


# ---------------------------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"verify_ms": [math.nan, 11.0, 12.0, 13.0, 14.0]}, r"verify_ms\[0\]"),
        ({"verify_ms": [10.0, -1.0, 12.0, 13.0, 14.0]}, r"verify_ms\[1\]"),
        ({"verify_ms": [10.0, 11.0, math.inf, 13.0, 14.0]}, r"verify_ms\[2\]"),
        ({"verify_ms": [10.0, 11.0, 12.0, "13", 14.0]}, r"verify_ms\[3\]"),
        ({"verify_ms": [10.0, 11.0, 12.0, 13.0, None]}, r"verify_ms\[4\]"),
        ({"verify_ms": [10.0, 11.0, 12.0, 13.0, True]}, r"verify_ms\[4\]"),
        ({"verify_ms": [10.0, 11.0]}, "verify_ms must be a list of 5"),
        ({"verify_ms": None}, "verify_ms must be a list"),
        ({"measured_ms": [10.0, 0.0, 12.0, 13.0, 14.0]}, r"measured_ms\[1\]"),
        ({"nodes": [1, 2, 2, 8, 16]}, "nodes must be unique and ascending"),
        ({"nodes": [1, 4, 2, 8, 16]}, "nodes must be unique and ascending"),
        ({"nodes": [0, 1, 2, 8, 16]}, r"nodes\[0\] must be an integer >= 1"),
        ({"nodes": [1, 2.0, 4, 8, 16]}, r"nodes\[1\]"),
        ({"nodes": "1,2,4,8,16"}, "nodes must be a non-empty list"),
        ({"nodes": {"1": 10.0}}, "nodes must be a non-empty list"),
        ({"nodes": []}, "nodes must be a non-empty list"),
        ({"nodes": None}, "nodes must be a non-empty list"),
        ({"machine": 5}, "machine must be a non-empty string"),
        ({"dtype": None}, "dtype must be a non-empty string"),
        ({"threads": 0}, "threads"),
        ({"quick": "no"}, "quick"),
        ({"step": ""}, "step must be a non-empty string"),
        ({"kernels": [1]}, "kernels must be a JSON object"),
        ({"colour": "red"}, r"unknown fields \['colour'\]"),
    ],
)
def test_a_malformed_cost_model_is_refused_naming_the_field(changes, field):
    target = tiny_target("llama")
    with pytest.raises(InvalidCostModelError, match=field):
        CostModel.from_json(cost_json(target, **changes))


@pytest.mark.parametrize(
    "kernels, field",
    [
        (
            {"linears": "cuBLAS"},
            r"kernels must be \{'linears': one of \['few_row', 'nn.Linear'\]\}, got \{'linears': 'cuBLAS'\}",
        ),
        ("few_row", "kernels must be"),
    ],
)
def test_a_malformed_kernel_record_is_refused_where_the_forward_reads_it(kernels, field):
    target = tiny_target("llama")
    with pytest.raises(InvalidCostModelError, match=f"tree.json: cost model: {field}"):
        prepare_target(target).load_cost_model(cost_json(target, kernels=kernels), "tree.json")


def test_a_cost_model_missing_a_field_or_not_an_object_is_refused():
    target = tiny_target("llama")
    data = cost_json(target)
    del data["dtype"]
    with pytest.raises(InvalidCostModelError, match=r"missing fields \['dtype'\]"):
        CostModel.from_json(data)
    for bad in ([1, 2], "cost", None):
        with pytest.raises(InvalidCostModelError, match="JSON object"):
            CostModel.from_json(bad)
    assert issubclass(CostModelError, ValueError)  # never a raw TypeError


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"target_fingerprint": "0123456789abcdef"}, "target_fingerprint"),
        ({"dtype": "torch.float64"}, "dtype"),
        ({"device": "cuda"}, "device"),
        ({"machine": f"{platform.machine()} Another CPU 9000"}, "machine"),
        ({"machine": platform.machine()}, "machine"),  # the architecture alone: not this machine's identity
        ({"step": "compiled (elsewhere)"}, "step"),
        ({"kernels": {"linears": "nn.Linear"}}, "linears"),  # measured with other layers than this target's
    ],
)
def test_a_cost_model_of_another_setup_is_refused_and_changes_nothing(changes, field):
    """Refused with the difference named; the target runs on as before (a cost model of a compiled step, refused,
    leaves it eager: no compile follows)."""
    target = tiny_target("llama")
    assert cost_json(target)["machine"] == machine_identity()
    prepared = prepare_target(target)
    with pytest.raises(CostModelMismatchError, match=f"tree.json: .*{field}"):
        prepared.load_cost_model(cost_json(target, **changes), "tree.json")
    assert prepared.compiled is None and prepared.step is prepared.eager and prepared.active is None


def test_a_measurement_whose_timer_gives_no_valid_time_is_refused_not_kept():
    target = tiny_target("llama")
    for bad in (math.nan, -1.0):

        def broken(what, run, bad=bad):
            run()
            return bad

        with pytest.raises(InvalidCostModelError, match="verify_ms"):
            measure_cost_model(prepare_target(target), sizes=(1, 2), prefix=8, repeats=1, timer=broken, attempts=1)


# ---------------------------------------------------------------------------------------------------------------------
# Implausible measurements: a scripted timer (the forwards still run), the checks and their decisions real


class ScriptedTimer:
    """Times every forward as `script(nodes, call)` ms, `call` counting the calls for that node count from 1 (a warm-up
    round, then the timed rounds, then a re-check of the smallest and largest size, attempt after attempt)."""

    def __init__(self, script):
        self.script, self.calls = script, {}

    def __call__(self, what, run) -> float:
        run()
        self.calls[what] = self.calls.get(what, 0) + 1
        return self.script(what, self.calls[what])


SIZES = (1, 2, 4, 8)
REPEATS = 2
PER_ATTEMPT = REPEATS + 1  # calls per size in one attempt's rounds; the smallest and largest are re-checked once more


def calm(nodes: int) -> float:
    return 10.0 + 0.5 * nodes


def measure(timer, attempts: int = 3) -> CostModel:
    target = tiny_target("llama")
    return measure_cost_model(prepare_target(target), SIZES, prefix=8, repeats=REPEATS, attempts=attempts, timer=timer)


def test_a_slow_spell_that_makes_trees_dearer_than_single_forwards_is_measured_again(caplog):
    """The shared-CPU case: one node 15 ms and every larger tree 219 ms in the first measurement, which would make every
    tree look dearer than single tokens and switch drafting off; measured again, it is calm."""

    def shared_cpu(nodes, call):
        first = call <= PER_ATTEMPT
        return (15.0 if nodes == 1 else 219.0) if first else calm(nodes)

    with caplog.at_level(logging.WARNING):
        cost = measure(ScriptedTimer(shared_cpu))
    assert cost.verify_ms == [calm(n) for n in SIZES]
    assert "measuring again" in caplog.text and "more than" in caplog.text
    assert cost.note.startswith("implausible: 2 nodes measured 219 ms") and "kept measurement 2" in cost.note


def test_noisy_rounds_and_a_dip_are_measured_again():
    def noisy_then_calm(nodes, call):
        if call <= PER_ATTEMPT:  # rounds of one size 10 and 30 ms apart
            return calm(nodes) + (20.0 if call % 2 else 0.0)
        if call <= 2 * PER_ATTEMPT:  # then 8 nodes measured far cheaper than 1
            return 2.0 if nodes == 8 else 20.0
        return calm(nodes)

    cost = measure(ScriptedTimer(noisy_then_calm))
    assert cost.verify_ms == [calm(n) for n in SIZES]
    assert "noisy" in cost.note and "non-monotone" in cost.note and "kept measurement 3" in cost.note


def test_a_re_check_far_from_the_measurement_is_measured_again():
    """Steady rounds, but the re-check of one node (its fourth call) takes four times as long: a spell covered all the
    rounds, so the measurement is repeated."""

    def spell_ends(nodes, call):
        return 4 * calm(nodes) if (nodes, call) == (1, PER_ATTEMPT + 1) else calm(nodes)

    cost = measure(ScriptedTimer(spell_ends))
    assert cost.verify_ms == [calm(n) for n in SIZES] and "re-check of 1 nodes" in cost.note


def test_a_measurement_implausible_every_time_falls_back_to_each_sizes_fastest_and_says_so(caplog):
    """A spell that lands on another size in each attempt: no attempt is plausible, each size's fastest median over
    the attempts is the calm curve."""

    def moving_spell(nodes, call):
        attempt = (call - 1) // PER_ATTEMPT  # no attempt is plausible, so none is re-checked
        return 30 * calm(nodes) if SIZES.index(nodes) == attempt + 1 else calm(nodes)

    with caplog.at_level(logging.WARNING):
        cost = measure(ScriptedTimer(moving_spell))
    assert cost.verify_ms == [calm(n) for n in SIZES] and cost.measured_ms == cost.verify_ms
    assert "still implausible after 3 measurements" in caplog.text
    assert "kept each size's fastest median over the attempts" in cost.note


# ---------------------------------------------------------------------------------------------------------------------
# First use, the cache, provenance


@pytest.mark.slow
def test_the_first_generation_measures_a_quick_estimate_and_a_second_model_reads_the_cache(cache_dir, caplog):
    with caplog.at_level(logging.INFO):
        model = lookup_model()
        assert_lossless(model)
    first = model.drafter.cost_model
    assert first.quick and first.source == "measured" and first.measured_at and first.nodes == list(QUICK_SIZES)
    assert first.kernels == {"linears": "few_row"}  # measured on this CPU's layers, and says so
    assert "quick first estimate" in caplog.text and str(cache_path(model.forward)) in caplog.text
    stored = json.loads(cache_path(model.forward).read_text())
    assert (
        stored["key"] == cache_key(model.forward) and stored["cost_model"]["verify_ms"] == first.to_json()["verify_ms"]
    )

    second = lookup_model()  # another copy of the target, as in a new process: read, not measured
    assert_lossless(second)
    assert second.drafter.cost_model.source == f"cache:{cache_path(second.forward)}"
    assert second.drafter.cost_model.verify_ms == pytest.approx(first.verify_ms, abs=1e-3)
    assert second.drafter.cost_model.measured_at == first.measured_at


@pytest.mark.slow
def test_a_full_measurement_replaces_the_quick_one_on_disk_too(cache_dir):
    model = lookup_model()
    assert_lossless(model, prompts=1)
    assert model.drafter.cost_model.quick
    full = model.forward.measure_cost_model(sizes=(1, 2, 4, 8), repeats=1)
    assert not full.quick and full.nodes == [1, 2, 4, 8]
    assert_lossless(model, prompts=1)
    assert model.drafter.cost_model is full  # the drafter sizes its trees by it from its next generation
    later = lookup_model()
    assert_lossless(later, prompts=1)
    assert not later.drafter.cost_model.quick and later.drafter.cost_model.source.startswith("cache:")
    assert later.drafter.cost_model.kernels == full.kernels


@pytest.mark.parametrize(
    "content",
    ["{not json", "\udcff", '["a list"]', '{"key": {}, "cost_model": {}}', "foreign key", "foreign cost model"],
)
def test_a_corrupt_or_foreign_cache_file_is_refused_with_a_log_line_and_measured_again(cache_dir, caplog, content):
    model = lookup_model()
    path = cache_path(model.forward)
    path.parent.mkdir()
    key, cost = cache_key(model.forward), cost_json(model.target)
    if content == "foreign key":  # a valid cost model, cached under another machine's key
        content = json.dumps({"key": key | {"machine": "x86_64 Other"}, "cost_model": cost})
    elif content == "foreign cost model":  # the right key, but a cost model of another dtype
        content = json.dumps({"key": key, "cost_model": cost | {"dtype": "torch.bfloat16"}})
    path.write_text(content, errors="surrogateescape")
    with caplog.at_level(logging.WARNING):
        assert_lossless(model, prompts=1)
    assert f"refusing the cached cost model {path}" in caplog.text
    assert model.drafter.cost_model.source == "measured" and model.drafter.cost_model.quick
    stored = json.loads(path.read_text())  # measured again, and cached in its place
    assert (
        stored["key"] == cache_key(model.forward)
        and stored["cost_model"]["measured_at"] == model.drafter.cost_model.measured_at
    )


def test_a_cached_cost_model_holds_only_for_the_same_layers_and_kernel_builds(monkeypatch):
    """Stock and few-row layers of one target time apart on one machine, as a rebuilt kernel does: each is cached under
    a key of its own, so neither is sized by the other's timings."""
    target = tiny_target("llama")
    few_row = prepare_target(target)  # this CPU's few-row layers, where it has them
    stock = prepare_target(tiny_target("llama"), tuned_layers=False)
    if any(isinstance(m, FewRowLinear) for m in few_row.target.modules()):
        assert cache_key(few_row)["linears"] == "few_row" and cache_key(stock)["linears"] == "nn.Linear"
        assert cache_path(few_row) != cache_path(stock)
    before = cache_path(stock)
    monkeypatch.setattr(KERNELS[-1], "build_key", lambda: "another build")
    assert cache_path(stock) != before


# ---------------------------------------------------------------------------------------------------------------------
# Machine profiles: what the tree search measured about this machine, passed as such; a tree file holds a tree


def write_test_profile(tmp_path, target, cost: dict | None, name: str = "profile.json", **identity) -> Path:
    """A machine profile of `target`'s eager step on this machine (its identity as `changes` say), holding `cost`."""
    prepared = prepare_target(target)
    data = MachineProfile(False, prepared.identity() | identity, None, 3).to_json() | {"cost_model": cost}
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_a_profile_round_trips_with_its_file_and_content_hash(tmp_path):
    target = tiny_target("llama")
    cost = CostModel.from_json(cost_json(target))
    made = MachineProfile("auto", prepare_target(target).identity(), cost, 4, {"prompt_lookup_timings": [1.5]})
    read = write_profile(made, tmp_path / "p.json")
    assert read.to_json() == made.to_json() and read_profile(read.path).to_json() == made.to_json()
    assert read.path == str(tmp_path / "p.json") and read.cost_model.source == f"file:{read.path}"
    assert read.sha256 == hashlib.sha256((tmp_path / "p.json").read_bytes()).hexdigest()
    assert (read.compile, read.prompt_lookup_num_tokens, read.measured) == ("auto", 4, {"prompt_lookup_timings": [1.5]})


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"version": 0}, "version 0"),
        ({"compile": "yes"}, "compile must be one of"),
        ({"identity": {"dtype": "torch.float32"}}, "identity must hold"),
        ({"prompt_lookup_num_tokens": 0}, "prompt_lookup_num_tokens"),
        ({"colour": "red"}, r"unknown \['colour'\]"),
        ({"cost_model": {"nodes": []}}, "cost model: missing fields"),
    ],
)
def test_a_malformed_profile_is_refused_naming_the_field(tmp_path, changes, field):
    target = tiny_target("llama")
    path = write_test_profile(tmp_path, target, cost_json(target))
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    with pytest.raises(InvalidProfileError, match=f"profile {path}: .*{field}"):
        read_profile(path)


def test_a_tree_file_passed_as_a_profile_is_refused_saying_so(tmp_path):
    path = save_tree(BudgetedTreeSpec(None, 6, 4), tmp_path / "tree.json", timings=[])
    with pytest.raises(InvalidProfileError, match="a tree file\\? pass it as tree="):
        read_profile(path)


def test_the_api_sizes_trees_by_a_profiles_cost_model_and_measures_none(cache_dir, tmp_path):
    target = tiny_target("llama")
    path = write_test_profile(tmp_path, target, cost_json(target))
    model = MedusaLikeModel(target, None, LookupDrafter(), backend="sdpa", profile=str(path))
    assert model.forward.profile.path == str(path) and model.forward.profile.prompt_lookup_num_tokens == 3
    assert_lossless(model)
    assert model.drafter.cost_model.source == f"file:{path}" and model.drafter.cost_model.verify_ms[0] == 10.25
    assert not cache_path(model.forward).exists()  # nothing was measured
    measured = model.forward.measure_cost_model(sizes=(1, 2), repeats=1)
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, eos_token_id=[])
    assert model.drafter.cost_model is measured  # a later measurement replaces the profile's, for this model


@pytest.mark.parametrize(
    "changes",
    [{"dtype": "torch.float64"}, {"machine": "other-arch Some CPU"}, {"target_fingerprint": "0123456789abcdef"}],
)
def test_the_api_refuses_a_profile_measured_for_another_setup_naming_the_difference(cache_dir, tmp_path, changes):
    target = tiny_target("llama")
    (field, value), cost = next(iter(changes.items())), cost_json(target, **changes)
    path = write_test_profile(tmp_path, target, cost, **changes)
    with pytest.raises(ProfileMismatchError, match=f"profile {path} was measured for another setup: {field} '{value}'"):
        MedusaLikeModel(target, None, LookupDrafter(), profile=path)
    bad = write_test_profile(
        tmp_path, target, cost_json(target, verify_ms=[10.0, math.nan, 12.0, 13.0, 14.0]), "n.json"
    )
    with pytest.raises(InvalidProfileError, match=r"verify_ms\[1\]"):
        MedusaLikeModel(target, None, LookupDrafter(), profile=bad)
    prepared = prepare_target(target)
    assert prepared.active is None and prepared.profile is None and not cache_path(prepared).exists()


def test_a_profile_of_the_compiled_step_is_refused_for_an_eager_one_naming_the_step(cache_dir, tmp_path):
    target = tiny_target("llama")
    step = "compiled (cpu, elsewhere)"
    path = write_test_profile(tmp_path, target, cost_json(target, step=step), step=step)
    with pytest.raises(ProfileMismatchError, match=f"step '{re.escape(step)}' \\(here 'eager"):
        MedusaLikeModel(target, None, LookupDrafter(), compile=False, profile=path)
    assert prepare_target(target).compiled is None


def test_a_tree_file_alone_never_compiles_or_switches_kernels(cache_dir, tmp_path, caplog):
    """A tree file of an earlier version that still holds a cost model (of the compiled step, with a kernel choice per
    size) is read as a tree: the target stays eager on its own layers, no cost model comes from the file, one log
    line says so."""
    model = lookup_model()
    kernels = {"linears": "few_row", "rows": {"1": "weight_first", "3": "padded", "5": "padded"}, "prefill": None}
    cost = cost_json(model.target, nodes=[1, 3, 5], verify_ms=[10.0, 11.0, 12.0], kernels=kernels)
    path = save_tree(
        BudgetedTreeSpec(None, 6, 4), tmp_path / "tree.json", cost_model=cost | {"step": "compiled (cpu, inductor)"}
    )
    with caplog.at_level(logging.WARNING, logger="medusa_like.decoding.tree_files"):
        assert_lossless(model, tree=str(path))
    assert model.forward.compiled is None and model.forward.step is model.forward.eager
    assert model.drafter.cost_model.source == "measured"  # this machine's own quick estimate, not the file's
    lines = [r for r in caplog.records if "also holds cost_model" in r.getMessage()]
    assert len(lines) == 1 and "profile=" in lines[0].getMessage()  # once per file, however often it is read


@pytest.mark.slow
def test_the_evaluation_reports_each_methods_cost_model_and_the_profile_it_ran_as(cache_dir, tmp_path, eval_cfg):
    """A lookup drafter on the dynamic tree: the quick estimate measured at start, no profile; then with
    `target.profile`: the profile's cost model and prompt lookup, the profile's file and content hash in the report."""
    from eval.evaluate import evaluate

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["Say three words."]}) + "\n")
    common = (
        "drafter.mode=lookup",
        "data.source=jsonl",
        f"data.path={questions}",
        "eval.max_new_tokens=4",
        "eval.sweep.prompts=0",
        "eval.warmup=false",
    )
    report = evaluate(eval_cfg(*common, "tree=dynamic", out_dir=tmp_path / "dynamic"))
    used = report["setup"]["cost_models"]["speculative"]
    assert used["source"] == "measured" and used["quick"] and report["summary"]["losslessness"] == 1.0
    assert "a quick first estimate from `measured`" in markdown(report) and report["setup"]["profile"] is None

    cost = used | {"verify_ms": [20.0 + n for n in used["nodes"]], "source": "measured"}
    identity = {name: cost[name] for name in IDENTITY}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(MachineProfile(False, identity, CostModel.from_json(cost), 3).to_json()))
    report = evaluate(eval_cfg(*common, "tree=dynamic", f"target.profile={path}", out_dir=tmp_path / "file"))
    used = report["setup"]["cost_models"]["speculative"]
    assert used["source"] == f"file:{path}" and used["verify_ms"][0] == 21.0
    sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
    assert report["setup"]["profile"] == {"path": str(path), "sha256": sha256}
    assert report["setup"]["step"].startswith("eager") and f"machine profile `{path}`" in markdown(report)
    assert report["summary"]["losslessness"] == 1.0 and report["setup"]["prompt_lookup_num_tokens"] == 3


# ---------------------------------------------------------------------------------------------------------------------
# A model the caller passes in


def test_swapping_a_passed_models_layers_is_logged_and_can_be_declined(caplog):
    with caplog.at_level(logging.INFO, logger="medusa_like.forward.prepared"):
        lookup_model()
    assert "replaced" in caplog.text and "nn.Linear layers of the target" in caplog.text
    caplog.clear()
    target = tiny_target("llama")
    with caplog.at_level(logging.INFO, logger="medusa_like.forward.prepared"):
        MedusaLikeModel(target, None, LookupDrafter(), tuned_layers=False)
    assert "replaced" not in caplog.text and not any(isinstance(m, FewRowLinear) for m in target.modules())
