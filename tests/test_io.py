"""Files written whole or not at all, and JSON Lines read with errors that name the line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from medusa_like.io import JsonLinesError, atomic_directory, atomic_file, read_jsonl, remove_stale_temporaries


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
