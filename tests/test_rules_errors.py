"""The last unclear errors of the training side: a run directory that cannot be created, `last.ckpt` with
`every_n_train_steps`, and two runs building the same data directory at once."""

import logging
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from medusa_like.data.prepare import ensure_dataset, load_model
from medusa_like.data.storage import is_complete, load_distilled

from .conftest import TINY_TRAIN, compose_config

ROOT = Path(__file__).resolve().parents[1]


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)


# ---- hydra.run.dir that cannot be created ---------------------------------------------------------------------------
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
        proc = run_module("train.train", *TINY_TRAIN, f"hydra.run.dir={run_dir}")
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, proc.stderr
        assert errors[0].startswith(f"error: cannot create the run directory hydra.run.dir={run_dir}: ")
        assert not run_dir.exists()


# ---- last.ckpt ------------------------------------------------------------------------------------------------------
class LastCheckpointProbe(Callback):
    """Records, at each epoch start and at the end of fitting, the step of checkpoints/last.ckpt and the step the
    previous epoch ended at."""

    def __init__(self, path: Path):
        self.path, self.seen, self.epoch_end_steps = path, [], []

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_end_steps.append(trainer.global_step)

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch > 0:
            self.seen.append(torch.load(self.path, map_location="cpu", weights_only=False)["global_step"])


@pytest.mark.parametrize(("every", "max_steps"), [(2, -1), (2, 7), (None, -1)])
def test_last_checkpoint_is_written_every_n_steps_at_every_epoch_end_and_at_the_end(
    tmp_path, train_cfg, every, max_steps
):
    overrides = [] if every is None else [f"callbacks.last_checkpoint.every_n_train_steps={every}"]
    cfg = train_cfg(*overrides)
    checkpoint = instantiate(cfg.callbacks.last_checkpoint)
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    probe = LastCheckpointProbe(last)
    saved_steps = []

    class StepRecorder(Callback):  # which steps last.ckpt held after each batch
        def on_train_batch_end(self, trainer, *args):
            if last.exists():
                saved_steps.append(torch.load(last, map_location="cpu", weights_only=False)["global_step"])

    trainer = L.Trainer(
        max_epochs=3,
        max_steps=max_steps,
        limit_train_batches=5,  # 5 steps per epoch: an epoch never ends on a multiple of 2
        limit_val_batches=1,
        callbacks=[checkpoint, probe, StepRecorder()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(BoringModel())
    final = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert final == trainer.global_step == (15 if max_steps == -1 else max_steps)
    assert probe.seen == probe.epoch_end_steps[: len(probe.seen)] and probe.seen  # each epoch's end was saved
    if every:
        assert {2, 4} <= set(saved_steps)  # and every N steps within the epoch
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]


# ---- two runs building one data directory ---------------------------------------------------------------------------
def build(name: str, tmp_path: Path, data: Path, gate: Path | None, results) -> None:
    """One run's data step (forked: a process of its own), counting its target forwards; logs into <name>.log."""
    handler = logging.FileHandler(tmp_path / f"{name}.log")
    logging.getLogger("medusa_like").addHandler(handler)
    logging.getLogger("medusa_like").setLevel(logging.INFO)
    cfg = compose_config("train", tmp_path / name, *TINY_TRAIN, data_dir=data)  # composed in the child: no fixture here
    target, tokenizer = load_model(cfg.model)
    forwards = []

    def count(module, args, output):  # the first forward waits for the test's go-ahead, if given a gate
        while gate is not None and not forwards and not gate.exists():
            time.sleep(0.05)
        forwards.append(1)

    target.register_forward_hook(count)
    ensure_dataset(cfg, target, tokenizer)
    results.put((name, len(forwards)))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_two_runs_building_one_data_directory_build_it_once(tmp_path, train_cfg):
    data, gate = tmp_path / "data", tmp_path / "go"
    data_dir = Path(train_cfg(out_dir=tmp_path / "probe", data_dir=data).data.dir)
    lock = data_dir.with_name(f".{data_dir.name}.build-shard0-of-1.lock")
    context = multiprocessing.get_context("fork")  # a process each, without re-importing torch
    results = context.Queue()
    first = context.Process(target=build, args=("first", tmp_path, data, gate, results))
    first.start()  # holds the build lock, stopped at its first target forward
    wait_for(
        lambda: (tmp_path / "first.log").exists() and "distilling" in (tmp_path / "first.log").read_text(),
        300,
        "the first run never started building",
    )
    second = context.Process(target=build, args=("second", tmp_path, data, None, results))
    second.start()
    try:
        wait_for(
            lambda: (tmp_path / "second.log").exists() and "waiting for" in (tmp_path / "second.log").read_text(),
            300,
            "the second run did not wait for the first",
        )
    finally:
        gate.touch()
    counts = dict(results.get(timeout=300) for _ in range(2))
    first.join(timeout=60)
    second.join(timeout=60)
    assert first.exitcode == second.exitcode == 0 and lock.exists()
    assert counts["first"] > 0 and counts["second"] == 0, counts  # the second found the rows built
    assert is_complete(data_dir) and len(load_distilled(data_dir)) > 0
