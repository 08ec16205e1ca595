"""Bad input to the evaluation and the export is one clear error before any work: config values of the wrong type,
a store seeding that cannot be, a question selection past the end, question files with null fields, an export dtype
that the format does not write. A question file with a byte-order mark is read. The lookup store's seeding is reported
as it happened, and the evaluation's command exits 1 when an output differs from the reference."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eval.evaluate import evaluate
from medusa_like.apps.config_checks import ConfigError, check_config, unset_keys
from medusa_like.apps.export import EXPORT_CHECKS, export
from medusa_like.data.split import training_answers
from medusa_like.evaluation.questions import QuestionSetError, load_jsonl_questions, select
from medusa_like.evaluation.report import store_sentence
from medusa_like.evaluation.setup import load_eval_setup
from medusa_like.formats.gguf import PRECISIONS, gguf_precision

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
]
FAST = ("target.tuned_layers=false", "eval.sweep.prompts=0", "eval.head_accuracy=false", "eval.warmup=false")


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Config values


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("drafter.seed_store=-5", "drafter.seed_store: expected an integer >= 0, got -5"),
        ("drafter.seed_store=1.5", "drafter.seed_store: expected an integer >= 0, got 1.5"),
        ("drafter.seed_store=true", "drafter.seed_store: expected an integer >= 0, got True"),
        ("drafter.seed_store=abc", "drafter.seed_store: expected an integer >= 0, got 'abc'"),
        ("drafter.store_tokens=0", "drafter.store_tokens: expected an integer >= 1, got 0"),
        ("eval.max_new_tokens=1.5", "eval.max_new_tokens: expected an integer >= 1, got 1.5"),
        ("eval.max_new_tokens=null", "eval.max_new_tokens: expected an integer >= 1, got None"),
        ("eval.max_new_tokens='16'", "eval.max_new_tokens: expected an integer >= 1, got '16'"),
        ("data.limit=1.5", "data.limit: expected an integer >= 1 or null, got 1.5"),
        ("data.limit=all", "data.limit: expected an integer >= 1 or null, got 'all'"),
        ("data.skip=null", "data.skip: expected an integer >= 0, got None"),
        ("data.skip=1.5", "data.skip: expected an integer >= 0, got 1.5"),
        ("data.skip='2'", "data.skip: expected an integer >= 0, got '2'"),
        ("eval.resume=yes", "eval.resume: expected true or false, got 'yes'"),
        ("eval.warmup=1", "eval.warmup: expected true or false, got 1"),
        ("eval.fp32_reference=always", "eval.fp32_reference: must be auto, true or false, got 'always'"),
        ("eval.fp32_reference=1", "eval.fp32_reference: must be auto, true or false, got 1"),
        (
            "eval.methods=lookup",
            "eval.methods: expected a non-empty list of names (eval.methods=[a,b]) or null, got 'lookup'",
        ),
        ("eval.methods=[]", "eval.methods: expected a non-empty list of names (eval.methods=[a,b]) or null, got []"),
        (
            "drafter.dtype=bf16",
            "drafter.dtype: expected a torch floating-point dtype name such as float32 or bfloat16 or null "
            "(or one of ['auto']), got 'bf16'",
        ),
    ],
)
def test_bad_eval_values_are_refused_before_any_work(tmp_path, eval_cfg, override, message):
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    cfg = eval_cfg(f"data.path={questions}", f"out_dir={tmp_path / 'run'}", override)
    with pytest.raises(ConfigError, match=f"^{re.escape('config key ' + message)}$"):
        evaluate(cfg)
    assert not (tmp_path / "run").exists()


def test_a_directory_for_the_question_file_or_the_tree_file_is_refused_before_the_model_loads(tmp_path, eval_cfg):
    from medusa_like.apps.tree_search import tree_search

    with pytest.raises(QuestionSetError, match=r"is a directory \(expected an MT-Bench-form JSONL file\)"):
        load_jsonl_questions(tmp_path)
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    cfg = eval_cfg(f"data.path={questions}", f"out_dir={tmp_path / 'run'}", f"tree_search.out={tmp_path}", *FAST)
    with pytest.raises(IsADirectoryError, match=f"tree_search.out={tmp_path} is a directory: name the file"):
        tree_search(cfg)
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    cfg = eval_cfg(f"data.path={questions}", f"tree_search.out={blocked / 'tree.json'}", *FAST)
    with pytest.raises(OSError, match="no file can be written there"):
        tree_search(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("tree_search.budgeted.num_nodes=[0]", "BudgetedTreeSpec.num_nodes must be a positive integer, got 0"),
        ("tree_search.budgeted.lookup_depth=0", "BudgetedTreeSpec.lookup_depth must be a positive integer, got 0"),
        ("tree_search.budgeted.num_nodes=[]", "tree_search.budgeted needs at least one node budget"),
        ("tree_search.budgeted.num_nodes=5", "'int' object is not iterable"),
        ("tree_search.dynamic=[]", "tree_search.dynamic needs at least one [depth, top_k, num_nodes] row"),
    ],
)
def test_bad_candidate_trees_are_refused_before_the_target_is_loaded(
    tmp_path, eval_cfg, monkeypatch, override, message
):
    """The tree search's candidates are checked by the functions that build them, before the target is loaded and
    its cost model measured (minutes on a real target; `num_nodes=[0]` was refused only after them)."""
    from medusa_like.apps import tree_search as app

    def loaded(*args, **kwargs):
        raise AssertionError("the target was loaded before the candidates were checked")

    monkeypatch.setattr(app, "load_eval_model", loaded)
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    cfg = eval_cfg(f"data.path={questions}", f"out_dir={tmp_path / 'run'}", override, *FAST)
    with pytest.raises(ConfigError, match=re.escape(message)):
        app.tree_search(cfg)


def test_skipping_every_question_is_refused_before_the_model_loads(tmp_path, eval_cfg):
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    cfg = eval_cfg(f"data.path={questions}", "data.skip=2", f"out_dir={tmp_path / 'run'}", *FAST)
    with pytest.raises(QuestionSetError, match=r"^skip=2 drops every question: the set holds 2$"):
        evaluate(cfg)
    assert list((tmp_path / "run").iterdir()) == []  # no prompt log, no settings
    with pytest.raises(QuestionSetError, match=r"limit must be an integer >= 1 or None, got 1.5"):
        select(load_jsonl_questions(questions), limit=1.5)
    with pytest.raises(QuestionSetError, match=r"skip must be an integer >= 0, got True"):
        select(load_jsonl_questions(questions), skip=True)
    assert [q.question_id for q in select(load_jsonl_questions(questions), skip=1)] == ["2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("format=native", "dtype=q8_0"), r"dtype: expected a torch floating-point dtype name .* got 'q8_0'"),
        (("format=vllm", "dtype=f16"), r"dtype: expected a torch floating-point dtype name .* got 'f16'"),
        (("format=gguf", "dtype=bfloat16"), r"dtype: format=gguf writes dtype f32, f16 or q8_0, not 'bfloat16'"),
    ],
)
def test_an_export_dtype_the_format_does_not_write_is_refused_first(tmp_path, export_cfg, overrides, message):
    with pytest.raises(ConfigError, match=f"config key {message}"):
        export(export_cfg(*overrides))
    assert not (tmp_path / "out").exists()


def test_required_keys_left_unset_are_named_before_anything_loads(tmp_path):
    """`???` keys the command did not set: one ConfigError naming each, before the target loads or anything is
    written (before: omegaconf's traceback, after loading the target and the drafter)."""
    from .conftest import compose_config

    for overrides, message in (
        ((), "config keys drafter.path, out are required: give drafter.path=... out=..."),
        (("drafter.path=none",), "config key out is required: give out=..."),
    ):
        cfg = compose_config("export", tmp_path, "model=tiny_llama", *overrides)
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            export(cfg)
        assert not any(tmp_path.rglob("config.yaml"))
    assert unset_keys({"a": {"b": "???", "c": [1, "???"]}, "d": "x"}) == ["a.b", "a.c.1"]


# what each format writes: gguf its own types (PRECISIONS) and their torch names, or none (f32), each to the GGUF type
# named here; the others any torch floating-point dtype, or none (the drafter's own)
GGUF_WRITES = {"f32": "f32", "f16": "f16", "q8_0": "q8_0", "float32": "f32", "float16": "f16", "null": "f32"}
WRITES = {
    "gguf": list(GGUF_WRITES),
    "native": ["float32", "bfloat16", "float16", "null"],
    "vllm": ["float32", "bfloat16", "float16", "null"],
}
NOT_WRITTEN = [("gguf", "bfloat16"), ("gguf", "float64"), ("native", "q8_0"), ("vllm", "f16"), ("native", "int8")]


@pytest.mark.slow
def test_every_dtype_a_format_writes_passes_and_no_other(export_cfg):
    """The config check takes every dtype a format writes (and gguf's are the types its writer maps them to), and
    refuses, naming it, each dtype the format does not write: a check that took everything fails here."""
    assert set(PRECISIONS) <= set(GGUF_WRITES)  # every type the gguf writer has is tried
    for fmt, dtypes in WRITES.items():
        for dtype in dtypes:
            check_config(export_cfg(f"format={fmt}", f"dtype={dtype}"), EXPORT_CHECKS)  # raises if refused
            if fmt == "gguf":
                assert gguf_precision(None if dtype == "null" else dtype) == GGUF_WRITES[dtype]
    for fmt, dtype in NOT_WRITTEN:
        with pytest.raises(ConfigError, match=f"^config key dtype: .*'{dtype}'"):
            check_config(export_cfg(f"format={fmt}", f"dtype={dtype}"), EXPORT_CHECKS)


# ---------------------------------------------------------------------------------------------------------------------
# Question files


def test_a_question_file_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(q) + "\n" for q in QUESTIONS).encode())
    assert [(q.question_id, q.category) for q in load_jsonl_questions(path)] == [("1", "writing"), ("2", "math")]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question_id": 3, "category": None, "turns": ["a"]}, r"q.jsonl:2: 'category' must be a string .* got None"),
        ({"question_id": None, "category": "x", "turns": ["a"]}, r"q.jsonl:2: 'question_id' must be .* got None"),
        ({"question_id": True, "turns": ["a"]}, r"q.jsonl:2: 'question_id' must be .* got True"),
        ({"question_id": [3], "turns": ["a"]}, r"q.jsonl:2: 'question_id' must be .* got \[3\]"),
        ({"question_id": 3, "category": 7, "turns": ["a"]}, r"q.jsonl:2: 'category' must be a string .* got 7"),
    ],
)
def test_null_or_odd_question_fields_are_refused_with_their_line(tmp_path, record, message):
    path = write_jsonl(tmp_path / "q.jsonl", [QUESTIONS[0], record])
    with pytest.raises(QuestionSetError, match=message):
        load_jsonl_questions(path)


# ---------------------------------------------------------------------------------------------------------------------
# The lookup store's seeding, as it happened


@pytest.mark.slow
def test_the_store_seeding_is_reported_as_it_happened(tmp_path, eval_cfg):
    answers = ["One, two.", "One, two, three.", "One.", "One, two, three, four.", "Zero."] * 2
    conversations = write_jsonl(
        tmp_path / "conversations.jsonl",
        [
            {"id": f"c{i}", "conversations": [{"from": "human", "value": f"Count {i}."}, {"from": "gpt", "value": a}]}
            for i, a in enumerate(answers)
        ],
    )
    split = (f"validation.source={conversations}", "validation.val_fraction=0.5")
    model, filling = load_eval_setup(eval_cfg(*split, "drafter.seed_store=1000"))
    store = model.drafter.lookup.store
    assert 0 < store.num_tokens < 1000 and len(store) > 1
    # the training split's answers, each tokenized alone, in order: batched tokenization changes nothing
    expected = [
        model.tokenizer(a, add_special_tokens=False)["input_ids"] for a in training_answers(str(conversations), 0.5)
    ]
    assert list(store.documents) == expected[: len(store)]
    assert filling == {
        "loaded_from": None,
        "loaded_tokens": 0,
        "max_tokens": store.max_tokens,
        "seed_budget_tokens": 1000,
        "seeded_answers": len(store),
        "seeded_tokens": store.num_tokens,
        "seeded_from": f"answers of the training split of {conversations}",
    }
    assert f"seeded with {store.num_tokens} tokens ({len(store)} answers of the training split" in store_sentence(
        filling
    )

    saved = store.save(tmp_path / "store.json")  # a loaded store that fills the budget: seeding adds nothing
    model, filling = load_eval_setup(eval_cfg(*split, f"drafter.store={saved}", f"drafter.seed_store={len(store)}"))
    assert model.drafter.lookup.store.num_tokens == filling["loaded_tokens"] == store.num_tokens
    assert filling["seeded_tokens"] == filling["seeded_answers"] == 0
    assert "seeded with nothing" in store_sentence(filling)

    _, filling = load_eval_setup(eval_cfg(*split, "drafter.seed_store=0"))
    assert filling["seeded_tokens"] == 0 and filling["seeded_from"] is None
    assert "started empty, not seeded" in store_sentence(filling)
    _, filling = load_eval_setup(eval_cfg(*split, "drafter.mode=learned", "drafter.seed_store=1000"))
    assert filling is None  # no store, nothing to report


# ---------------------------------------------------------------------------------------------------------------------
# The command's exit status

LOSSY_RUN = """
import sys
from medusa_like.evaluation.methods import METHODS, SPECULATIVE
from tests.test_eval_mismatch import lossy
METHODS[SPECULATIVE] = lossy(METHODS[SPECULATIVE])
from eval.evaluate import main
sys.argv = ["eval.evaluate", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_the_evaluate_command_exits_1_when_an_output_differs(tmp_path):
    """`python -m eval.evaluate` (the Hydra app behind medusa-evaluate) with a speculative method that changes one
    token: the report is written, says so, stderr says so in one line, and the process ends with status 1 (0 with
    eval.fail_on_mismatch=false)."""
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    overrides = ["model=tiny_llama", "drafter.mode=learned", "drafter.seed_store=0", f"data.path={questions}"]
    overrides += ["tree=chain", "eval.max_new_tokens=8", "eval.methods=[hf_greedy,speculative]", *FAST]
    overrides += ["target.compile=false"]  # the exit status, not the compiled step (tests/test_compiled.py)
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environ.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for fail, status in (("true", 1), ("false", 0)):
        run = tmp_path / f"run-{fail}"
        args = [*overrides, f"eval.fail_on_mismatch={fail}", f"out_dir={run}", f"hydra.run.dir={tmp_path / fail}"]
        done = subprocess.run(
            [sys.executable, "-c", LOSSY_RUN, *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == status, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        [line] = [line for line in done.stderr.splitlines() if line.startswith("not lossless:")]
        assert line.startswith("not lossless: speculative differs from hf_greedy on 2 of 2 prompts (margins ")
        report = json.loads((run / "report.json").read_text())
        assert not report["summary"]["lossless"] and report["losslessness"]["fraction"] == 0.0
