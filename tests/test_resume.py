"""A resumed evaluation continues only a run of the same settings: every setting that decides a prompt's record is
recorded in the run directory before the first prompt, and `eval.resume=true` with any other value is refused before
any work, naming each differing key with both values. The target and the drafter are recorded by their weights, so
replaced weights under the same name or path are refused and a moved drafter is not. A report builds for every
decoding mode and subset of methods."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from eval.evaluate import evaluate
from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads
from medusa_like.evaluation.run_settings import SETTINGS_FILE, ResumeMismatchError
from medusa_like.formats import load_drafter, save_drafter
from medusa_like.targets import load_target, weights_fingerprint
from medusa_like.tiny import tiny_chat_target

from .conftest import compose_config

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it about snow."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
]
ANSWERS = ["One, two.", "One, two, three.", "One.", "One, two, three, four.", "Zero."]
FAST = ("target.tuned_layers=false", "eval.sweep.prompts=0", "eval.head_accuracy=false", "eval.warmup=false")


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def compose(files: Path, out_dir: Path, *overrides: str):
    """The run of these tests: combined drafter, a store seeded from `files`' small conversation set, chain tree."""
    split = (f"validation.source={files / 'conversations.jsonl'}", "validation.val_fraction=0.5")
    return compose_config(
        "eval",
        out_dir / "hydra",
        "model=tiny_llama",
        "data.source=jsonl",
        f"data.path={files / 'q.jsonl'}",
        "tree=chain",
        "eval.max_new_tokens=4",
        "drafter.seed_store=1000",
        *split,
        *FAST,
        f"out_dir={out_dir}",
        *overrides,
    )


def kill_after_first_prompt(run: Path) -> str:
    """The run directory as a kill during the second prompt leaves it; returns what prompts.jsonl then holds."""
    log = run / "prompts.jsonl"
    first = log.read_text().splitlines(keepends=True)[0]
    log.write_text(first)
    (run / "report.json").unlink()
    return first


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """(files, run directory, its first run's report), the run killed after its first prompt."""
    files = tmp_path_factory.mktemp("files")
    write_jsonl(files / "q.jsonl", QUESTIONS)
    write_jsonl(files / "q2.jsonl", QUESTIONS[1:])
    conversations = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": f"Count to {i}."}, {"from": "gpt", "value": a}]}
        for i, a in enumerate(ANSWERS * 2)
    ]
    write_jsonl(files / "conversations.jsonl", conversations)
    (files / "store.json").write_text("{}")
    (files / "drafter").mkdir()
    run = tmp_path_factory.mktemp("run")
    report = evaluate(compose(files, run))
    kill_after_first_prompt(run)
    return files, run, report


@pytest.mark.parametrize(
    ("override", "differences"),
    [
        ("eval.max_new_tokens=3", ["eval.max_new_tokens: 4 in the run, 3 now"]),
        (
            "model=tiny_qwen2",
            ["model.name_or_path: 'tiny_llama' in the run, 'tiny_qwen2' now", "model.loader.family: 'llama'"],
        ),
        ("model.loader.seed=1", ["model.loader.seed: 0 in the run, 1 now"]),
        ("model.dtype=bfloat16", ["model.dtype: 'float32' in the run, 'bfloat16' now"]),
        ("drafter.mode=lookup", ["drafter.mode: 'combined' in the run, 'lookup' now"]),
        ("drafter.num_heads=2", ["drafter.num_heads: 4 in the run, 2 now"]),
        ("tree=small", ["tree: 'chain' in the run, 'small' now"]),
        ("data.source=mt_bench", ["data.source: 'jsonl' in the run, 'mt_bench' now"]),
        ("data.path={files}/q2.jsonl", ["data.path: '{files}/q.jsonl' in the run", "sha256(data.path): '"]),
        ("data.skip=1", ["data.skip: 0 in the run, 1 now"]),
        ("data.limit=1", ["data.limit: None in the run, 1 now"]),
        ("data.max_turns=1", ["data.max_turns: 2 in the run, 1 now"]),
        ("data.per_category=1", ["data.per_category: None in the run, 1 now"]),
        ("eval.methods=[hf_greedy,speculative]", ["eval.methods: None in the run, ['hf_greedy', 'speculative'] now"]),
        ("eval.prompt_lookup_num_tokens=3", ["eval.prompt_lookup_num_tokens: 'auto' in the run, 3 now"]),
        ("eval.threads=1", ["eval.threads: None in the run, 1 now"]),
        ("target.backend=eager", ["target.backend: 'auto' in the run, 'eager' now"]),
        ("target.tuned_layers=null", ["target.tuned_layers: False in the run, None now"]),
        ("drafter.seed_store=500", ["drafter.seed_store: 1000 in the run, 500 now"]),
        ("drafter.store_tokens=5000", ["drafter.store_tokens: 2000000 in the run, 5000 now"]),
        ("drafter.store={files}/store.json", ["drafter.store: None in the run, '{files}/store.json' now"]),
        ("validation.split_seed=3", ["validation.split_seed: 0 in the run, 3 now"]),
        ("validation.val_fraction=0.25", ["validation.val_fraction: 0.5 in the run, 0.25 now"]),
        ("validation.source={files}/q.jsonl", ["validation.source: '{files}/conversations.jsonl' in the run"]),
        ("seed=1", ["seed: 0 in the run, 1 now"]),
    ],
)
def test_resuming_with_another_setting_is_refused_before_any_work(killed, override, differences):
    files, run, _ = killed
    log_before = (run / "prompts.jsonl").read_bytes()
    cfg = compose(files, run, "eval.resume=true", override.format(files=files))
    with pytest.raises(ResumeMismatchError) as refusal:
        evaluate(cfg)
    message = str(refusal.value)
    assert "eval.resume=true" in message and str(run) in message
    for difference in differences:
        assert difference.format(files=files) in message
    assert (run / "prompts.jsonl").read_bytes() == log_before  # nothing run, nothing lost
    assert not (run / "report.json").exists()


def test_two_differences_are_both_named(killed):
    files, run, _ = killed
    with pytest.raises(ResumeMismatchError, match=r"eval.max_new_tokens: 4 in the run, 16 now; .*seed: 0 .*, 2 now"):
        evaluate(compose(files, run, "eval.resume=true", "eval.max_new_tokens=16", "seed=2"))


@pytest.mark.slow
def test_the_same_settings_resume_and_keep_the_finished_prompts(killed, tmp_path):
    files, run, first = killed
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    kept = (copy / "prompts.jsonl").read_text()
    resumed = evaluate(compose(files, copy, "eval.resume=true"))
    lines = (copy / "prompts.jsonl").read_text().splitlines(keepends=True)
    assert lines[0] == kept and len(lines) == 3
    assert resumed["summary"]["lossless"] and resumed["acceptance"]["prompts"] == 3
    assert [(p["question_id"], p["turn"]) for p in resumed["prompts"]] == [("1", 1), ("1", 2), ("2", 1)]
    # the store was seeded alike, and the report says how, as it happened
    assert resumed["setup"]["lookup_store"] == first["setup"]["lookup_store"]


def save_target(directory: Path, seed: int) -> Path:
    """The tiny llama of `seed`, saved with its tokenizer as a model directory (what `load_target` reads by path)."""
    model, tokenizer = tiny_chat_target("llama", seed=seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_heads(directory: Path, seed: int, overwrite: bool = False) -> Path:
    """Two Medusa heads for the tiny llama, every parameter random from `seed` (a drafter trained again)."""
    target, _ = tiny_chat_target("llama")
    heads = MedusaHeads(HeadsConfig(target.config.hidden_size, target.config.vocab_size, num_heads=2))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return save_drafter(heads, directory, target, "tiny_llama", overwrite=overwrite)


@pytest.mark.slow
def test_other_weights_under_the_same_name_or_path_are_refused_and_a_moved_drafter_is_not(tmp_path):
    """The target and the drafter are recorded by their weights: target files replaced under the same path (another
    seed of the same config) and a drafter trained again at the same path are refused, naming both fingerprints of
    each; the same drafter under another path continues the run."""
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    target, heads, run = save_target(tmp_path / "target", 0), save_heads(tmp_path / "heads", 0), tmp_path / "run"

    def compose_run(drafter: Path, *overrides: str):
        return compose_config(
            "eval", tmp_path / "hydra", f"model.name_or_path={target}", "drafter.mode=learned", f"drafter.path={drafter}",
            f"data.path={questions}", "tree=chain", "eval.max_new_tokens=4", *FAST, f"out_dir={run}", *overrides,
        )  # fmt: skip

    evaluate(compose_run(heads))
    kill_after_first_prompt(run)
    recorded = json.loads((run / SETTINGS_FILE).read_text())["settings"]
    assert "drafter.path" not in recorded and "target weights" in recorded and "drafter weights" in recorded

    save_target(tmp_path / "other", 1)  # the same config, other weights, put in the first one's place
    (tmp_path / "target").rename(tmp_path / "first")
    (tmp_path / "other").rename(target)
    with pytest.raises(ResumeMismatchError) as refusal:
        evaluate(compose_run(heads, "eval.resume=true"))
    before, now = recorded["target weights"], weights_fingerprint(load_target(str(target))[0])
    assert before != now and f"target weights: '{before}' in the run, '{now}' now" in str(refusal.value)
    shutil.rmtree(target)
    (tmp_path / "first").rename(target)

    (tmp_path / "heads").rename(tmp_path / "moved")  # the same drafter elsewhere
    save_heads(tmp_path / "heads", 1)  # and one trained again in its place
    with pytest.raises(ResumeMismatchError) as refusal:
        evaluate(compose_run(heads, "eval.resume=true"))
    now = weights_fingerprint(load_drafter(heads, load_target(str(target))[0]))
    assert f"drafter weights: '{recorded['drafter weights']}' in the run, '{now}' now" in str(refusal.value)
    assert len((run / "prompts.jsonl").read_text().splitlines()) == 1  # nothing run, nothing lost

    resumed = evaluate(compose_run(tmp_path / "moved", "eval.resume=true"))
    assert resumed["acceptance"]["prompts"] == 3 and resumed["summary"]["lossless"]


def test_prompts_without_recorded_settings_are_not_continued(killed, tmp_path):
    files, run, _ = killed
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / SETTINGS_FILE).unlink()
    with pytest.raises(ResumeMismatchError, match=f"holds prompts but no {SETTINGS_FILE}"):
        evaluate(compose(files, copy, "eval.resume=true"))


@pytest.mark.slow
def test_the_content_of_the_tree_and_question_files_is_recorded(tmp_path):
    """A tree file or a question file rewritten under the same path is refused, each naming its hash."""
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"paths": [[0], [0, 0]]}))
    run = tmp_path / "run"
    overrides = ("model=tiny_llama", "drafter.mode=learned", f"data.path={questions}", f"tree={tree}")
    overrides += ("eval.max_new_tokens=4", *FAST, f"out_dir={run}")
    evaluate(compose_config("eval", tmp_path / "hydra", *overrides))
    kill_after_first_prompt(run)

    tree.write_text(json.dumps({"paths": [[0], [1], [0, 0]]}))
    with pytest.raises(ResumeMismatchError, match=r"sha256\(tree\): '[0-9a-f]{64}' in the run, '[0-9a-f]{64}' now"):
        evaluate(compose_config("eval", tmp_path / "hydra", *overrides, "eval.resume=true"))
    tree.write_text(json.dumps({"paths": [[0], [0, 0]]}))

    write_jsonl(questions, [*QUESTIONS, {"question_id": 3, "category": "math", "turns": ["What is 2 + 2?"]}])
    with pytest.raises(ResumeMismatchError, match=r"sha256\(data.path\): '[0-9a-f]{64}' in the run"):
        evaluate(compose_config("eval", tmp_path / "hydra", *overrides, "eval.resume=true"))
    write_jsonl(questions, QUESTIONS)

    resumed = evaluate(compose_config("eval", tmp_path / "hydra", *overrides, "eval.resume=true"))
    assert resumed["acceptance"]["prompts"] == 3 and resumed["summary"]["lossless"]


@pytest.mark.slow
def test_a_resumed_search_keeps_the_tree_the_first_run_chose(tmp_path):
    """tree=auto: the tree search's result is recorded with the settings; a resumed run decodes with that tree
    instead of searching again (a new search on a busy machine may pick another)."""
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    run = tmp_path / "run"
    overrides = ("model=tiny_llama", "drafter.mode=learned", f"data.path={questions}", "tree=auto")
    overrides += ("tree_search.calibration.source=jsonl", f"tree_search.calibration.path={questions}")
    overrides += ("tree_search.budgets=[1,2]", "tree_search.timing_prompts=1", "eval.max_new_tokens=4")
    overrides += (*FAST, f"out_dir={run}")
    first = evaluate(compose_config("eval", tmp_path / "hydra", *overrides))
    kill_after_first_prompt(run)
    searched = (run / "tree.json").stat()
    resumed = evaluate(compose_config("eval", tmp_path / "hydra", *overrides, "eval.resume=true"))
    assert (run / "tree.json").stat().st_mtime_ns == searched.st_mtime_ns  # not searched (nor written) again
    assert resumed["tree_search"] == first["tree_search"]
    assert resumed["setup"]["tree"] == first["setup"]["tree"] and resumed["summary"]["lossless"]

    (run / "tree.json").write_text(json.dumps({"paths": [[0]]}))
    with pytest.raises(ResumeMismatchError, match=r"sha256\(searched tree\)"):
        evaluate(compose_config("eval", tmp_path / "hydra", *overrides, "eval.resume=true"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "methods", "timed"),
    [
        ("combined", "null", {"plain_loop", "learned", "lookup", "speculative"}),
        ("combined", "[hf_greedy,speculative]", {"speculative"}),
        ("combined", "[lookup]", {"lookup", "speculative"}),
        ("lookup", "null", {"plain_loop", "speculative"}),
        ("learned", "[plain_loop]", {"plain_loop", "speculative"}),
    ],
)
def test_a_report_builds_for_every_mode_and_subset_of_methods(tmp_path, mode, methods, timed):
    questions = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[1:])
    cfg = compose_config(
        "eval",
        tmp_path / "hydra",
        "model=tiny_llama",
        f"drafter.mode={mode}",
        f"eval.methods={methods}",
        f"data.path={questions}",
        "eval.max_new_tokens=4",
        *FAST,
        f"out_dir={tmp_path / 'run'}",
    )
    report = evaluate(cfg)
    assert set(report["methods"]) == timed  # this project's methods: those with decoding statistics
    assert set(report["speed"]["median_tokens_per_second"]) >= {"hf_greedy", "hf_prompt_lookup", *timed}
    assert report["summary"]["lossless"] and (tmp_path / "run" / "report.md").is_file()
