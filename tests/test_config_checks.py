"""The entry points' shared behaviour: config values checked when composed (every checked key exists), one-line errors
(a run directory that cannot be created among them), data directories."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from medusa_like.apps.config_checks import DISTILL_CHECKS, EVAL_CHECKS, TRAIN_CHECKS, ConfigError, Number, check_config
from medusa_like.data.naming import source_name
from tests.conftest import TINY_TRAIN, compose_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("trainer.max_epochs=abc", r"trainer.max_epochs: expected an integer >= -1 or null, got 'abc'"),
        ("data.module.batch_size=0", r"data.module.batch_size: expected an integer >= 1, got 0"),
        ("module.optimizer.lr=fast", r"module.optimizer.lr: expected a number >= 0.0, got 'fast'"),
        ("trainer.max_steps=1.5", r"trainer.max_steps: expected an integer >= -1, got 1.5"),
    ],
)
def test_bad_train_values_name_the_key_before_anything_runs(override, pattern, tmp_path, train_cfg):
    from train.train import train

    cfg = train_cfg(override)
    with pytest.raises(ConfigError, match=pattern):
        train(cfg)
    assert not any(tmp_path.iterdir())  # nothing built, nothing written


@pytest.mark.slow
def test_bad_eval_values_and_good_defaults(train_cfg, eval_cfg):
    check_config(eval_cfg(), EVAL_CHECKS)
    for drafter in ("medusa", "eagle3"):
        check_config(train_cfg(f"drafter={drafter}"), TRAIN_CHECKS)
    with pytest.raises(ConfigError, match=r"eval.max_new_tokens: expected an integer >= 1, got -3"):
        check_config(eval_cfg("eval.max_new_tokens=-3"), EVAL_CHECKS)
    with pytest.raises(ConfigError, match=r"data.limit: expected an integer >= 1 or null, got 'all'"):
        check_config(eval_cfg("data.limit=all"), EVAL_CHECKS)


@pytest.mark.slow
def test_the_default_drafter_is_eagle3_and_every_checked_key_exists(tmp_path, train_cfg):
    assert train_cfg().drafter.kind == "eagle3"
    for drafter in ("eagle3", "medusa", "medusa_own_lm_head"):
        check_config(train_cfg(f"drafter={drafter}"), TRAIN_CHECKS)
    check_config(compose_config("distill", tmp_path, "model=tiny_llama", "data=tiny"), DISTILL_CHECKS)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["drafter=medusa", "drafter.heads.num_heads=0"], r"drafter.heads.num_heads: expected an integer >= 1, got 0"),
        (
            ["drafter=eagle3", "drafter.module.ttt_steps=0"],
            r"drafter.module.ttt_steps: expected an integer >= 1, got 0",
        ),
        (["~data.chunk_size"], r"config key data.chunk_size: checked, but the config has no such key"),
        (["drafter=eagle3", "drafter.module.loss=kl"], r"drafter.module.loss: unknown drafter loss 'kl'"),
        (["target_read_kernel=mkl"], r"target_read_kernel: expected one of \['auto', 'onednn', 'linear'\], got 'mkl'"),
        (
            ["distill.engine=vlm"],
            r"distill.engine: expected one of \['transformers', 'medusa_like', 'vllm'\], got 'vlm'",
        ),
    ],
)
def test_checks_refuse_bad_values_and_missing_keys(train_cfg, overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_config(train_cfg(*overrides), TRAIN_CHECKS)


def test_a_checked_key_with_a_typo_is_refused_not_skipped(train_cfg):
    cfg = train_cfg("drafter=medusa")
    with pytest.raises(ConfigError, match="drafter.num_heads"):
        check_config(cfg, {"drafter.num_heads": Number(min=1)})
    check_config(cfg, {"drafter.module.ttt_steps": Number(min=1, when=("drafter.kind", "eagle3"))})  # not medusa's
    check_config(cfg, {"drafter.module.ttt_steps": Number(min=1, if_present=True)})  # a key medusa's config lacks
    with pytest.raises(ConfigError, match="drafter.module.ttt_steps: expected an integer >= 1"):
        check_config(
            train_cfg("drafter.module.ttt_steps=0"), {"drafter.module.ttt_steps": Number(min=1, if_present=True)}
        )


def run(module: str, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environ.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    command = [sys.executable, "-m", module, *overrides]
    return subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_expected_failures_print_one_line_and_full_error_keeps_the_traceback(tmp_path):
    bad_value = run("train.train", *TINY_TRAIN, "trainer.max_epochs=abc", f"hydra.run.dir={tmp_path / 'a'}")
    assert bad_value.returncode == 1
    assert "error: config key trainer.max_epochs: expected an integer" in bad_value.stderr
    assert "Traceback" not in bad_value.stderr

    missing = tmp_path / "no_such_drafter"
    args = ("model=tiny_llama", f"drafter.path={missing}", f"out={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'b'}")
    export = run("train.export", *args)
    assert export.returncode == 1 and "Traceback" not in export.stderr
    assert "error: " in export.stderr and str(missing) in export.stderr
    assert not (tmp_path / "out").exists()

    verbose = run("train.export", *args, HYDRA_FULL_ERROR="1")
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def unwritable_run_dirs(tmp_path: Path) -> list[Path]:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    dirs = [a_file / "run"]  # mkdir fails with an OSError, as on a read-only file system
    if os.geteuid() != 0:  # root ignores permissions
        read_only = tmp_path / "read_only"
        read_only.mkdir(mode=0o555)
        dirs.append(read_only / "run")
    return dirs


@pytest.mark.slow
def test_a_run_directory_that_cannot_be_created_is_one_error_line(tmp_path):
    for run_dir in unwritable_run_dirs(tmp_path):
        proc = run("train.train", *TINY_TRAIN, f"hydra.run.dir={run_dir}")
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, proc.stderr
        assert errors[0].startswith(f"error: cannot create the run directory hydra.run.dir={run_dir}: ")
        assert not run_dir.exists()


@pytest.mark.slow
def test_a_refused_training_run_leaves_the_run_directory_as_it_was(tmp_path):
    """A resume of a checkpoint that is not there, or a fresh run where a run is, is refused in one line before Hydra
    writes its `.hydra/` files and log into the run directory (they were overwritten with the refused run's)."""
    run_dir = tmp_path / "run"
    files = {".hydra/config.yaml": "the first run's config\n", ".hydra/overrides.yaml": "- its overrides\n",
             "train.log": "its log\n"}  # fmt: skip
    for name, text in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    resumed = run("train.train", *TINY_TRAIN, "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert f"error: ckpt_path=last resumes this run's own directory only, and {run_dir} holds no" in resumed.stderr
    files["checkpoints/last.ckpt"] = "its checkpoint"
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_text(files["checkpoints/last.ckpt"])
    fresh = run("train.train", *TINY_TRAIN, f"hydra.run.dir={run_dir}")
    assert f"error: {run_dir} already holds a run (checkpoints/last.ckpt): resume it" in fresh.stderr
    for proc in (resumed, fresh):
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert {name: (run_dir / name).read_text() for name in files} == files
    assert len([p for p in run_dir.rglob("*") if p.is_file()]) == len(files)  # nothing else written


@pytest.mark.slow
def test_different_local_sources_get_different_data_directories(tmp_path, train_cfg):
    a, b = tmp_path / "A.jsonl", tmp_path / "sub" / "A.jsonl"
    b.parent.mkdir()
    a.write_text("{}\n")
    b.write_text("{}\n")
    dirs = {train_cfg("data=local", f"data.source={s}").data.dir for s in (a, b)}
    assert len(dirs) == 2 and all("/local-A-" in d for d in dirs)
    assert {Path(d).name for d in dirs} == {f"local-{source_name(str(a))}", f"local-{source_name(str(b))}"}
    assert source_name(str(a)).startswith("A-") and source_name(str(a)) != source_name(str(b))
    assert source_name("sharegpt") == "sharegpt"  # a named source keeps its name
