"""Files written whole or not at all, and JSON Lines and training checkpoints read with errors that name the line or
file."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from medusa_like.io import (
    CheckpointError,
    JsonLinesError,
    atomic_directory,
    atomic_file,
    read_jsonl,
    read_training_checkpoint,
    remove_stale_temporaries,
)


def test_an_interrupted_write_keeps_the_previous_file(tmp_path):
    path = atomic_file(tmp_path / "a.txt", lambda tmp: tmp.write_text("old"))

    def crash(tmp: Path):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_file(path, crash)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_a_directory_appears_whole(tmp_path):
    target = tmp_path / "d"
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        (tmp / "x").write_text("1")
        raise RuntimeError("killed halfway")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_directory(target) as tmp:
        (tmp / "x").write_text("1")
    assert (target / "x").read_text() == "1"
    with pytest.raises(FileExistsError), atomic_directory(target) as tmp:
        (tmp / "y").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["x"]


def test_temporaries_of_dead_writers_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".model.safetensors.tmp-{dead.stdout.strip()}"
    stale.write_text("partial")
    mine = tmp_path / f".other.tmp-{os.getppid()}"  # a live process's: left alone
    mine.write_text("in progress")
    assert remove_stale_temporaries(tmp_path) == [stale.name]
    assert mine.exists() and not stale.exists()


def test_jsonl_errors_name_the_file_and_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"b": 2}\n')
    assert list(read_jsonl(path)) == [(1, {"a": 1}), (3, {"b": 2})]
    path.write_bytes(b'{"a": 1}\n{"b": \n')
    with pytest.raises(JsonLinesError, match=r"q.jsonl:2: malformed JSON line"):
        list(read_jsonl(path))
    path.write_bytes(b'{"a": 1}\n{"b": "\xff\xfe"}\n')
    with pytest.raises(JsonLinesError, match=r"q.jsonl:2: not UTF-8 text"):
        list(read_jsonl(path))


def test_a_training_checkpoint_is_read_whole_or_refused_naming_the_file(tmp_path, caplog):
    """Tensors load without unpickling; hyper-parameters that need it load after a warning, or at once when trusted;
    a file cut short and one without a required key are one `CheckpointError` naming the file."""
    weights = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 3}
    torch.save(weights, plain := tmp_path / "plain.ckpt")
    with caplog.at_level("WARNING"):
        assert torch.equal(read_training_checkpoint(plain, ("state_dict",))["state_dict"]["w"], torch.arange(4.0))
    assert not caplog.records
    torch.save(weights | {"hyper_parameters": OmegaConf.create({"lr": 0.1})}, rich := tmp_path / "rich.ckpt")
    with caplog.at_level("WARNING"):
        assert read_training_checkpoint(rich, ("state_dict",))["hyper_parameters"].lr == 0.1
    assert "holds more than tensors" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert read_training_checkpoint(rich, ("state_dict",), trusted=True)["global_step"] == 3
    assert not caplog.records
    (cut := tmp_path / "cut.ckpt").write_bytes(rich.read_bytes()[:300])
    with pytest.raises(CheckpointError, match=f"ckpt_path={cut} is not a readable training checkpoint"):
        read_training_checkpoint(cut, ("state_dict",), name=f"ckpt_path={cut}")
    with pytest.raises(
        CheckpointError, match=rf"{plain} is not a medusa_like training checkpoint: it lacks \['kind'\]"
    ):
        read_training_checkpoint(plain, ("state_dict", "kind"))
