"""This project's C++ kernels, built on first use by torch's extension builder and loaded once per process.

    kernel = Extension("tree_attention", fakes={op: shape_fn})   # tree_attention.cpp beside this file
    why = kernel.load()                                          # None once loaded; else why it cannot be built here
    kernel.build_key()                                           # a build's source, flags, torch, machine
    kernel.built(); build_in_background(kernel, ...)            # kernels the first call should not wait for
    kernel.error                                                 # a failed build's whole output (the compiler's)

A kernel is built (a few seconds) into the user cache, in a directory named by its build key, so a later process of
the same source, flags, torch and machine loads the built library, and a changed one builds anew. Each kernel
registers its operators in the `medusa_like` namespace (`torch.ops.medusa_like.<op>`) and gives their shapes for
tracing (`fakes`).

A build that fails leaves the step on its fallback (each kernel's module logs one line saying which, and why): the
library runs on, a little slower or less exact against greedy decoding where a near-tie falls. The test suite does not
run on: on a machine meant to build the kernels (an x86 CPU with AVX2 and a C++ compiler, `compiler_missing`), a
failed build fails it with the compiler's output (tests/conftest.py).
"""

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from medusa_like.io import user_cache_dir

from .machine import machine_identity

log = logging.getLogger(__name__)

# -ffp-contract=off: a multiply and an add stay two roundings in wide and narrow registers alike (no fused
# multiply-add in one and not the other), so the same source gives the same bits however the compiler vectorizes it
# -fopenmp: ATen's parallel_for splits the work over torch's threads (without it, it runs on one)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
# torch's builder waits for the lock file of a build in progress for as long as it exists, and a build killed midway
# leaves it behind: one older than this (a build takes seconds) is a dead build's, and is removed
STALE_LOCK_SECONDS = 600
BUILD_FAILED = "build_failed.txt"  # why a background build failed, in its build directory


class Extension:
    """The kernel `<name>.cpp` beside this file, built with `FLAGS`; `fakes` maps each operator it defines
    ("medusa_like::<op>") to the function that gives its output's shape and dtype for tracing."""

    def __init__(self, name: str, fakes: dict):
        self.name, self.fakes = name, fakes
        self.source = Path(__file__).with_name(f"{name}.cpp")
        self.error: str | None = None  # the whole output of this process's failed build (the compiler's), if one failed

    def build_key(self) -> str:
        """What a build depends on: the kernel's source, the flags, torch's version and the machine (digest)."""
        text = "\n".join([self.source.read_text(encoding="utf-8"), *FLAGS, torch.__version__, machine_identity()])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def directory(self) -> Path:
        return user_cache_dir() / "kernels" / f"{self.name}-{self.build_key()}"

    def load(self) -> str | None:
        """Build (or reuse) and load the kernel: None when its operators run, else why not. Called once per process
        (by its module's cached `unavailable()`)."""
        from torch.utils import cpp_extension

        directory = self.directory()
        try:
            _find_ninja()
            directory.mkdir(parents=True, exist_ok=True)
            clear_stale_lock(directory)
            if not any(directory.glob("*.so")):
                log.info(
                    "building the %s kernel into %s: once for this machine and torch (seconds)", self.name, directory
                )
            # the builder takes a lock in `directory`: two processes building at once build it once
            cpp_extension.load(
                name=f"medusa_like_{self.name}",
                sources=[str(self.source)],
                extra_cflags=list(FLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
            )
        except Exception as err:  # no compiler, no ninja, a failed build: each raises its own type
            self.error = f"{type(err).__name__}: {err}"
            return f"the {self.name} kernel could not be built ({type(err).__name__}: {first_error(str(err))})"
        for op, fake in self.fakes.items():
            torch.library.register_fake(op)(fake)
        (directory / BUILD_FAILED).unlink(missing_ok=True)  # an earlier failure no longer holds
        return None

    def built(self) -> bool:
        """Whether this machine's cache holds the built library (a later process loads it in milliseconds)."""
        return any(self.directory().glob("*.so"))

    def build_failure(self) -> str | None:
        """Why a background build failed here (its last line), or None."""
        failed = self.directory() / BUILD_FAILED
        if not failed.is_file():
            return None
        return failed.read_text(encoding="utf-8").strip() or "failed"


def first_error(output: str) -> str:
    """The line of a build's `output` that says what went wrong: the compiler's first error, else the last line
    (torch's builder ends it with ninja's "build stopped", which says nothing of the cause)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines[1:] if "error:" in line.lower()]  # the first line is torch's "Error building"
    return errors[0] if errors else (lines[-1] if lines else "")


def compiler_missing() -> str | None:
    """Why torch's extension builder finds no C++ compiler here (it runs `$CXX`, else `c++`), or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} ($CXX, else c++) is not on the PATH"
    return None


def build_in_background(*kernels: Extension) -> None:
    """Build `kernels` one after the other in a detached process at the lowest priority, for later processes (logged):
    this one does not wait. A failure is kept in its kernel's build directory (`build_failure`), not tried again."""
    for kernel in kernels:
        kernel.directory().mkdir(parents=True, exist_ok=True)
        log.info(
            "building the %s kernel into %s in the background, for later processes (this one runs without it)",
            kernel.name,
            kernel.directory(),
        )
    code = (  # at the lowest priority: the process that asked keeps the cores
        "import os, sys; os.nice(19); from medusa_like.forward.cpu.extension import BUILD_FAILED, Extension\n"
        "for name, directory in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    why = Extension(name, {}).load()\n"
        "    why and open(directory + '/' + BUILD_FAILED, 'w').write(why)\n"
    )
    subprocess.Popen(
        [sys.executable, "-c", code, *(part for k in kernels for part in (k.name, str(k.directory())))],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives this process; a Ctrl-C here does not cut it
    )


def clear_stale_lock(directory: Path) -> bool:
    """Remove the build lock in `directory` if a killed build left it (older than `STALE_LOCK_SECONDS`), with a log
    line; whether it did."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_SECONDS:
        return False
    log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _find_ninja() -> None:
    """Put the `ninja` package's binary on PATH where no other is (torch's builder runs `ninja` by name, and a
    virtual environment's scripts are on PATH only when it is activated)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # the builder's own error says what is missing
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
