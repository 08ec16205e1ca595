"""Where a compiled step's artifacts live on disk: one directory per target weights, dtype, device, compiler settings,
library versions and machine, so that a later process reuses what an earlier one built and nothing built for another
setup is ever read.

    path = package_path(step)          # on CPUs: the AOTInductor package of the step's graph (`compiled.py`)
    with compile_cache(step):          # Inductor's own caches (generated kernels, autotuning results) here while building

The directory is `compiled/<key digest>/` under `io.user_cache_dir()`, with `key.json` naming what it was built for.
A directory whose `key.json` is missing, unreadable or names another key (a digest collision, a copy from elsewhere, a
half-written directory) is emptied and rebuilt, with a log line. The package is written under a temporary name and
renamed into place when complete: a killed build leaves no package that a later process would load.

On CPUs the package holds the whole compiled step (the generated code, compiled, and the frozen, packed weights): a
later process loads it in seconds instead of compiling for minutes. On GPUs the step is compiled in-process with CUDA
graphs, and the directory holds Inductor's caches only (generated kernels and autotuning results).
"""

import hashlib
import inspect
import json
import logging
import platform
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

from medusa_like.io import user_cache_dir, write_json
from medusa_like.targets import weights_fingerprint

from .cpu.machine import machine_identity

log = logging.getLogger(__name__)

KEY_FILE = "key.json"
PACKAGE_FILE = "step.pt2"
CACHE_VERSION = 2  # part of the key: raised when what is cached here changes meaning


def cache_key(step) -> dict:
    """What a compiled step's artifacts were built for (`step`: a `compiled.CompiledStep`)."""
    target = step.target
    return {
        "version": CACHE_VERSION,
        # the graph: the target's class and config (two families can share weights' shapes and values, not their
        # forward) and the code that builds the graph around it
        "target_class": type(target).__name__,
        "target_config": _digest(target.config.to_json_string(use_diff=False)),
        "step_code": _digest(Path(inspect.getfile(type(step))).read_text(encoding="utf-8")),
        "target_fingerprint": weights_fingerprint(target),
        "dtype": str(target.dtype),
        "device": target.device.type,
        "options": {key: step.options[key] for key in sorted(step.options)},
        "rows": [step.min_rows, step.max_rows],  # the node counts the graph is compiled for
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": machine_identity(),
    }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_directory(step) -> Path:
    return user_cache_dir() / "compiled" / _digest(json.dumps(cache_key(step), sort_keys=True))


def checked_directory(step) -> Path:
    """The step's cache directory, emptied first unless its `key.json` names this very key; the key written."""
    directory, key = cache_directory(step), cache_key(step)
    key_file = directory / KEY_FILE
    if directory.exists():
        try:
            found = json.loads(key_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            found = f"unreadable ({err})"
        if found != key:
            log.warning("the compile cache %s was built for %s, not for this step: rebuilding it", directory, found)
            shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    if not key_file.exists():
        write_json(key_file, key)
    return directory


@contextmanager
def compile_cache(step):
    """Inductor's on-disk caches in the step's directory for the block (its first calls: the compiles)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    directory = checked_directory(step)
    with temporary_cache_dir(str(directory)):
        yield directory


def package_path(step) -> Path:
    """The step's AOTInductor package in its checked directory (`checked_directory`); it may not exist yet."""
    return checked_directory(step) / PACKAGE_FILE


def is_cached(step) -> bool:
    """Whether this step's directory holds an earlier process's package (`package_path`), or artifacts of an
    earlier compile."""
    directory = cache_directory(step)
    return (directory / KEY_FILE).is_file() and any(p.name != KEY_FILE for p in directory.iterdir())
