"""Where a compiled step's artifacts live on disk: one directory per target weights, dtype, device, compiler settings,
library versions and machine, so that a later process reuses what an earlier one built and nothing built for another
setup is ever read.

    with compile_cache(step):      # Inductor's caches (generated kernels, autotuning results) point here while compiling
        compiled(*inputs)

The directory is `compiled/<key digest>/` under `io.user_cache_dir()`, with `key.json` naming what it was built for.
Inductor keys its own entries by their source too; the key here keeps another target's or another version's artifacts
out of the directory altogether, and a directory whose `key.json` is missing, unreadable or names another key (a
digest collision, a copy from elsewhere, a half-written directory) is emptied and rebuilt, with a log line.

What a later process skips: compiling the generated C++ kernels and benchmarking the GEMM choices. What it still does:
tracing the target's forward and generating the code, which takes most of a compile on a CPU (the FX graph cache
cannot hold a graph whose frozen weights are MKL-packed).
"""

import hashlib
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
CACHE_VERSION = 1  # part of the key: raised when what is cached here changes meaning


def cache_key(step) -> dict:
    """What a compiled step's artifacts were built for (`step`: a `compiled.CompiledStep`)."""
    target = step.target
    return {
        "version": CACHE_VERSION,
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


def cache_directory(step) -> Path:
    key = cache_key(step)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return user_cache_dir() / "compiled" / digest


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


def is_cached(step) -> bool:
    """Whether this step's directory holds artifacts of an earlier compile (a later process compiles faster)."""
    directory = cache_directory(step)
    return (directory / KEY_FILE).is_file() and any(p.name != KEY_FILE for p in directory.iterdir())
