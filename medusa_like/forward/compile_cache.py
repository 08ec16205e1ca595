"""How a compiled graph (the target's step, `compiled.py`; a drafter's level or heads, `compiled_draft.py`) is compiled,
and where its artifacts live on disk: one directory per model weights, dtype, device, compiler settings, library
versions and machine, so that a later process reuses what an earlier one built and nothing built for another setup is
ever read.

    run = Package(graph, step)         # CPUs: the AOTInductor package at `package_path(step)`, built or loaded
    run = InProcess(graph, step)       # GPUs: torch.compile with CUDA graphs, Inductor's caches in the directory
    logits, hidden, states, new = run(input_ids, position_ids, slots, mask, buffer)

The directory is `compiled/<key digest>/` under `io.user_cache_dir()`, with `key.json` naming what it was built for.
A directory whose `key.json` is missing, unreadable or names another key (a digest collision, a copy from elsewhere, a
half-written directory) is emptied and rebuilt, with a log line. The package is written under a temporary name and
renamed into place when complete: a killed build leaves no package that a later process would load.

On CPUs the package holds the whole compiled step (the generated code, compiled, and the frozen, packed weights): a
later process loads it in seconds instead of compiling for minutes. Building one takes several times the weights'
bytes in memory, and loading one about four times: where the machine has less available, the build or load is refused
(`NotEnoughMemory`, before any work) and the step runs eagerly. On GPUs the step is compiled in-process with CUDA
graphs, and the directory holds Inductor's caches only (generated kernels and autotuning results).
"""

import hashlib
import inspect
import json
import logging
import os
import platform
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from torch._inductor import config as inductor_config

from medusa_like.io import user_cache_dir, write_json
from medusa_like.targets import weights_fingerprint

from .cpu import bf16_linear, tree_attention
from .cpu.machine import machine_identity

log = logging.getLogger(__name__)

KEY_FILE = "key.json"
PACKAGE_FILE = "step.pt2"
CACHE_VERSION = 3  # part of the key: raised when what is cached here changes meaning (3: noexcept micro-kernels)
# in-process, every compiled step compiles one function (`compiled._Graph`) for its own target: the compiler's
# default of 8 per function would send a process's ninth target (tests, several models) back to eager
RECOMPILE_LIMIT = 64
PROFILER_NAME = "medusa_like compiled step"  # how a profiler names a call of the compiled package (CPUs)
PROGRESS_SECONDS = 30.0  # how often a long compile logs that it is still at work
# the memory a CPU package takes beyond the loaded model, in multiples of the model's weight bytes: a build holds the
# frozen weights beside their packed copies, and loading copies the package's constants out of its library; set a little
# above the peaks measured on the default target (docs/cpu-kernels.md, "What it costs")
BUILD_MEMORY, LOAD_MEMORY = 7.0, 4.0


class NotEnoughMemory(MemoryError):
    """A compiled step that would not fit in this machine's available memory (the eager step runs instead)."""


def cache_key(step) -> dict:
    """What a compiled step's artifacts were built for (`step`: a `compiled.CompiledStep`, or a
    `compiled_draft.CompiledLevel` or `CompiledHeads`): what it computes (`step.graph_key()`: the model's class,
    config, weights, dtype and device), the code around it, the compiler's settings, the sizes it is compiled for, the
    libraries and the machine."""
    graph = step.graph_key()
    return {
        "version": CACHE_VERSION,
        **graph,
        "step_code": _digest(Path(inspect.getfile(type(step))).read_text(encoding="utf-8")),
        "options": {key: step.options[key] for key in sorted(step.options)},
        "rows": [step.min_rows, step.max_rows],  # the node counts the graph is compiled for
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": machine_identity(),
        "attention": attention_key(graph["device"]),
        "products": products_key(graph["device"], graph["dtype"]),
    }


def attention_key(device: str) -> str:
    """How a graph on `device` attends: the row-invariant kernel's build (CPUs where it builds) or SDPA."""
    if device != "cpu" or tree_attention.unavailable() is not None:
        return "sdpa"
    return f"tree_attention-{tree_attention.KERNEL.build_key()}"


def products_key(device: str, dtype: str) -> str:
    """How a graph of `dtype` on `device` computes its products: the bf16 dot-product kernel's build (bf16 on CPUs
    where it runs: `cpu/bf16_linear.py`) or Inductor's own (the C++ GEMM template on CPUs)."""
    if device != "cpu" or dtype != str(torch.bfloat16) or bf16_linear.unavailable() is not None:
        return "inductor"
    return f"bf16_linear-{bf16_linear.KERNEL.build_key()}"


def failure(err: Exception) -> str:
    """Why a compiled graph failed, in one line for the log and its `failed` field: the error's type and first line."""
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def model_key(model, role: str, config_text: str, code_of: type | None = None) -> dict:
    """`cache_key`'s part for one model (`role`: "target" or "drafter"): its class and config (two families can
    share weights' shapes and values, not their forward), its weights' fingerprint, dtype and device, and where its
    forward is this project's code (`code_of`), that code."""
    key = {
        f"{role}_class": type(model).__name__,
        f"{role}_config": _digest(config_text),
        f"{role}_fingerprint": weights_fingerprint(model),
        "dtype": str(next(model.parameters()).dtype),
        "device": next(model.parameters()).device.type,
    }
    if code_of is not None:
        key[f"{role}_code"] = _digest(Path(inspect.getfile(code_of)).read_text(encoding="utf-8"))
    return key


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


@contextmanager
def progress(doing: str, every: float | None = None):
    """Log "still <doing>: N s so far" every `every` seconds (`PROGRESS_SECONDS`) while the block runs: Inductor's
    code generation and C++ build say nothing for minutes."""
    every = PROGRESS_SECONDS if every is None else every
    done, start = threading.Event(), time.perf_counter()

    def report():
        while not done.wait(every):
            log.info("  still %s: %.0f s so far", doing, time.perf_counter() - start)

    reporter = threading.Thread(target=report, name="compile progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()


def available_memory() -> int | None:
    """Bytes of memory this machine can give a process now (Linux's MemAvailable), or None where that is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(graph: torch.nn.Module, times: float, doing: str) -> None:
    """`NotEnoughMemory` if `doing` would need more than the available memory: `times` the bytes of `graph`'s weights
    (its parameters and buffers, each counted once)."""
    weights = sum(t.numel() * t.element_size() for t in (*graph.parameters(), *graph.buffers()))
    free = available_memory()
    if free is not None and times * weights > free:
        raise NotEnoughMemory(
            f"{doing} would take about {times * weights / 2**30:.1f} GiB of memory ({times:g}x the weights' "
            f"{weights / 2**30:.2f} GiB) and {free / 2**30:.1f} GiB is available"
        )


class Package:
    """The step's graph compiled ahead of time into an AOTInductor package (`package_path`), loaded
    from there when an earlier process built it: traced once by `torch.export` over the step's dynamic sizes, and
    compiled with the step's Inductor options."""

    def __init__(self, graph, step):
        path = package_path(step)
        start = time.perf_counter()
        if path.is_file():
            check_memory(graph, LOAD_MEMORY, f"loading {step.what} compiled")
            # the package calls the kernels its key names (`attention`, `products`): `cache_key` loaded them
            try:
                self.run = torch._inductor.aoti_load_package(str(path))
                log.info("loaded %s compiled from %s in %.1f s", step.what, path, time.perf_counter() - start)
                return
            except Exception as err:  # a package this key's build did not finish or another version wrote
                log.warning("the compiled step at %s is unreadable (%s): compiling it again", path, err)
                path.unlink(missing_ok=True)
        self.run = torch._inductor.aoti_load_package(str(self._build(graph, step, path)))
        step.compile_seconds = time.perf_counter() - start
        log.info("compiled %s in %.1f s; saved to %s for later processes", step.what, step.compile_seconds, path)

    @staticmethod
    def _build(graph, step, path):
        # refused before minutes of work, not killed for memory in them
        check_memory(graph, BUILD_MEMORY, f"compiling {step.what}")
        log.info(
            "compiling %s (%s) on its first use: once for these weights, settings and machine "
            "(minutes for a 100M-parameter target on 2 cores; progress below)",
            step.what,
            step.label,
        )
        start = time.perf_counter()
        with step.traced_attention(), torch.no_grad():
            program = torch.export.export(
                graph, step.example_inputs(), dynamic_shapes=step.dynamic_sizes(), strict=False
            )
        log.info("  traced its graph in %.1f s; generating and compiling its kernels", time.perf_counter() - start)
        partial = path.with_name(f"{path.stem}.partial-{os.getpid()}{path.suffix}")  # AOTInductor wants .pt2
        try:  # without gradients, as the graph was traced: freezing folds what the weights alone give into constants
            with (
                torch.no_grad(),
                compile_cache(step),
                inductor_config.patch(step.options),
                progress("generating and compiling"),
            ):
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(partial), inductor_configs=dict(step.options)
                )
            os.replace(partial, path)  # complete, or absent: a killed build leaves only its partial file, never read
        finally:
            partial.unlink(missing_ok=True)  # a failed build's (a package is hundreds of MB for a 100M target)
        return path

    def __call__(self, *args):
        with torch.profiler.record_function(PROFILER_NAME):
            return self.run(*args)


class InProcess:
    """The step's graph compiled in this process by `torch.compile` (on GPUs: with CUDA graphs), its first call (the
    compile) timed and logged, with Inductor's caches in the step's directory (`compile_cache`)."""

    def __init__(self, graph, step):
        log.info("compiling %s (%s) on its first use: once per process", step.what, step.label)
        self.fn, self.step, self.first = torch.compile(graph, fullgraph=True, options=step.options), step, True

    def __call__(self, *args):
        for tensor, sizes in zip(args, self.step.dynamic_sizes().values(), strict=True):
            for dim, size in sizes.items():
                torch._dynamo.mark_dynamic(tensor, dim, min=size.min, max=size.max)
        # Inductor's options in its global config while the graph is traced (the first call, and any recompile):
        # Dynamo reads `freezing` there (not in torch.compile's options) to make the weights graph constants
        with inductor_config.patch(self.step.options), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            if not self.first:
                return self.fn(*args)
            start = time.perf_counter()
            with compile_cache(self.step) as directory, progress("compiling"):
                out = self.fn(*args)
            self.first = False
            self.step.compile_seconds = time.perf_counter() - start
            log.info("compiled %s in %.1f s (caches in %s)", self.step.what, self.step.compile_seconds, directory)
            return out
