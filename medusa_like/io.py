"""Files written whole or not at all, a lock file held while a directory is built, JSON Lines and training
checkpoints read with errors that name the line or file, and the user's cache directory.

Every file or directory this package writes whole goes through `atomic_file` or `atomic_directory`: the content is
written under a temporary name next to its destination (`.<name>.tmp-<pid>`) and renamed into place, so an interrupted
run leaves the previous content or nothing, never half of it. The exceptions are append-only logs (an evaluation's
`prompts.jsonl`, whose line cut short by a kill is dropped on resume) and what Lightning, Hydra and the loggers write
themselves. Temporaries of a killed run are recognisable by that name and are removed by `remove_stale_temporaries`.
"""

import fcntl
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def atomic_file(path: str | Path, write: Callable[[Path], None], mode: int = 0o644) -> Path:
    """Run `write(tmp)` and rename tmp to `path` (readable by others: `mode`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def user_cache_dir() -> Path:
    """Where this package keeps what it derives once per machine (cost models, the converted default
    target): `$MEDUSA_LIKE_CACHE_DIR`, else `$XDG_CACHE_HOME/medusa_like`, else `~/.cache/medusa_like`."""
    if os.environ.get("MEDUSA_LIKE_CACHE_DIR"):
        return Path(os.environ["MEDUSA_LIKE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "medusa_like"


def write_json(path: str | Path, data) -> Path:
    return atomic_file(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"))


def write_text(path: str | Path, text: str) -> Path:
    return atomic_file(path, lambda tmp: tmp.write_text(text))


@contextmanager
def atomic_directory(path: str | Path, exist_ok: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory next to `path`; on success it becomes `path`.

    If `path` appeared meanwhile (another process finished the same work first) it is kept and the temporary one is
    dropped when `exist_ok`, else FileExistsError.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            if not exist_ok:
                raise FileExistsError(f"{path} appeared while it was being written; the new copy was dropped")
        else:
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temporaries(directory: str | Path) -> list[str]:
    """Remove the temporaries that killed writers left in `directory` (not those of live processes)."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if not entry.name.startswith(".") or TMP_MARK not in entry.name:
            continue
        pid = entry.name.rsplit(TMP_MARK, 1)[1]
        if pid.isdigit() and _alive(int(pid)) and int(pid) != os.getpid():
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def exclusive_lock(path: str | Path, waiting: str = "") -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing) for the block: a second process asking for it
    waits (logging `waiting` once) until the first leaves the block or dies. The file itself stays, empty."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for %s: %s", path, waiting or "another process holds it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class CheckpointError(ValueError):
    """A training checkpoint that cannot be read or holds something else: the message names the file."""


class JsonLinesError(ValueError):
    """A JSON Lines file that cannot be read: the message names the file and the line."""


def read_jsonl(path: str | Path, opener=open) -> Iterator[tuple[int, object]]:
    """(line number, decoded JSON) for each non-blank line of a UTF-8 JSON Lines file (a byte-order mark, which some
    editors write first, is skipped)."""
    path = Path(path)
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise JsonLinesError(f"{path}:{lineno}: not UTF-8 text ({err.reason} at byte {err.start})") from err
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise JsonLinesError(
                    f"{path}:{lineno}: malformed JSON line ({err.msg}): {line.strip()[:80]!r}"
                ) from err


def existing_file(path: str | Path, what: str) -> Path:
    """`path` if it is a file; else FileNotFoundError or IsADirectoryError naming `what` and the path."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {str(path)!r} is a directory, expected a file")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    return path


def read_training_checkpoint(path: str | Path, required: Sequence[str], name: str = "", trusted: bool = False) -> dict:
    """The Lightning checkpoint at `path` (memory-mapped) as a dict holding every key of `required`; a file that is
    none, is cut short, or lacks a key is one `CheckpointError` that names it as `name` (default: the path).

    Tensors and plain containers are read with `weights_only`; a checkpoint whose hyper-parameters need full
    unpickling is read fully after a warning, or at once where it is `trusted` (one this run wrote, or resumes)."""
    name = name or str(path)

    def load(weights_only: bool) -> object:
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
            if weights_only and isinstance(err, pickle.UnpicklingError):
                raise
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(f"{name} is not a readable training checkpoint (cut short?): {first}") from err

    try:
        checkpoint = load(weights_only=not trusted)
    except pickle.UnpicklingError:
        log.warning("%s holds more than tensors: unpickling it fully (load checkpoints you trust only)", path)
        checkpoint = load(weights_only=False)
    missing = [key for key in required if not isinstance(checkpoint, dict) or key not in checkpoint]
    if missing:
        held = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(f"{name} is not a medusa_like training checkpoint: it lacks {missing}, holds {held}")
    return checkpoint
