"""llama.cpp itself: build its speculative-decoding executable, run it on one prompt, parse what it prints.

llama.cpp comes from a source distribution on PyPI (`llama-cpp-python` vendors it, EAGLE-3 included), downloaded
with pip, built CPU-only with cmake/ninja for the executables needed (`llama-speculative-simple` for one sequence,
`llama-server` for batches, see server.py) into `.llamacpp/` (git-ignored); a second run reuses the build.
Nothing from llama.cpp is committed or imported.

`--spec-type none` makes this version's `llama-speculative-simple` exit ("failed to initialize speculative
decoding": it builds no drafter), and `llama-simple` takes no thread count, so plain decoding (`PLAIN`) is
`ngram-simple` with the longest n-gram and m-gram it accepts: it drafts nothing while the sequence is under 2,049
tokens (`ctx_size` stays at most 2,048), and each step verifies one token, exactly plain decoding.

Every run is one process per prompt, greedy (`--temp 0`), the same number of threads for the target and the
drafter, every thread pool told not to busy-wait (`NO_POLLING`), holding the lock `flock /tmp/medusa_bench.lock`
takes, so no two benchmarks overlap. What it prints at the
end (`decoded N tokens in S seconds`, `n_drafted`, `n_accept`) is summed over the prompts per `Setting`.
"""

import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from medusa_like.io import exclusive_lock, write_json

log = logging.getLogger(__name__)

EXECUTABLE = "llama-speculative-simple"
SERVER = "llama-server"
BUILD_TOOLS = ("cmake", "ninja", "g++")
BENCH_LOCK = "/tmp/medusa_bench.lock"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this CPU's instruction set: the build is for this machine only
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",  # for the server; only the executables named are built
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",  # the server's web page is not needed (and its assets would be downloaded)
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_OPENSSL=OFF",
)


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be built or run here (no build tools, no network to PyPI, no build yet)."""


def bench_lock(path: str = BENCH_LOCK):
    """The same lock `flock` takes: held while this process times anything."""
    return exclusive_lock(path, waiting="another benchmark is running")


# ---------------------------------------------------------------------------------------------------------------------
# Build


def executable(cache: Path, name: str = EXECUTABLE) -> Path:
    return Path(cache) / "build" / "bin" / name


def source_dir(cache: Path, sdist: str) -> Path:
    """llama.cpp's source inside the unpacked sdist, downloaded with pip into `cache/sdist` the first time."""
    cache = Path(cache)
    downloads = cache / "sdist"
    name = sdist.split("==")[0].replace("-", "_")
    archives = sorted(downloads.glob(f"{name}-*.tar.gz"))
    if not archives:
        downloads.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", sdist, "-d"]
        done = subprocess.run([*command, str(downloads)], capture_output=True, text=True)
        archives = sorted(downloads.glob(f"{name}-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise LlamaCppUnavailable(f"pip could not download the source of {sdist}: {done.stderr.strip()[-500:]}")
    archive = archives[-1]
    unpacked = cache / "src" / archive.name.removesuffix(".tar.gz")
    if not unpacked.is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(cache / "src", filter="data")
    vendored = unpacked / "vendor" / "llama.cpp"
    if not (vendored / "src" / "models" / "eagle3.cpp").is_file():
        raise LlamaCppUnavailable(f"{archive.name} vendors a llama.cpp without EAGLE-3 (no src/models/eagle3.cpp)")
    return vendored


def default_cache() -> Path:
    """conf/llamacpp.yaml's `llamacpp.cache`: `.llamacpp` under $MEDUSA_LIKE_ROOT, else the working directory."""
    return Path(os.environ.get("MEDUSA_LIKE_ROOT", ".")) / ".llamacpp"


def missing_tools() -> list[str]:
    return [tool for tool in BUILD_TOOLS if shutil.which(tool) is None]


def unavailable_reason(cache: Path | None = None) -> str | None:
    """None when llama.cpp is built in `cache` (default: `default_cache()`) or can be built here; else why not. (A
    build can still fail later: no network to PyPI, a compiler error; `build` says so.)"""
    if executable(cache or default_cache()).is_file():
        return None
    missing = missing_tools()
    return f"building llama.cpp needs {missing} on PATH" if missing else None


def build(cache: Path, sdist: str, jobs: int = 2, name: str = EXECUTABLE) -> Path:
    """The executable `name` (llama-speculative-simple or llama-server), built once into `cache/build` (a second
    call only checks it)."""
    binary = executable(cache, name)
    if binary.is_file():
        return binary
    missing = missing_tools()
    if missing:
        raise LlamaCppUnavailable(f"building llama.cpp needs {missing} on PATH")
    source = source_dir(cache, sdist)
    build_dir, log_path = Path(cache) / "build", Path(cache) / "build.log"
    steps = (
        ["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *CMAKE_OPTIONS],
        ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", name],
    )
    log.info("building llama.cpp from %s into %s (log: %s)", source, build_dir, log_path)
    with log_path.open("a") as out:
        for step in steps:
            if subprocess.run(["nice", "-n", "10", *step], stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise LlamaCppUnavailable(f"building llama.cpp failed at `{' '.join(step)}`; see {log_path}")
    return binary


# ---------------------------------------------------------------------------------------------------------------------
# Run and parse

_PATTERNS = {
    "prompt_tokens": r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds",
    "decoded": r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds",
    "n_drafted": r"n_drafted\s*=\s*(\d+)",
    "n_accept": r"n_accept\s*=\s*(\d+)",
}


def parse_output(text: str) -> dict:
    """The figures `llama-speculative-simple` prints at its end; a ValueError naming what is missing otherwise."""
    found = {key: re.search(pattern, text) for key, pattern in _PATTERNS.items()}
    missing = [key for key, match in found.items() if match is None]
    if missing:
        raise ValueError(f"llama.cpp's output lacks {missing}; its last lines:\n{text[-1500:]}")
    return {
        "prompt_tokens": int(found["prompt_tokens"].group(1)),
        "prompt_seconds": float(found["prompt_tokens"].group(2)),
        "tokens": int(found["decoded"].group(1)),
        "seconds": float(found["decoded"].group(2)),
        "drafted": int(found["n_drafted"].group(1)),
        "accepted": int(found["n_accept"].group(1)),
    }


@dataclass
class Setting:
    name: str
    spec_type: str
    draft: Path | None = None
    n_max: int | None = None
    extra: tuple[str, ...] = ()

    def arguments(self) -> list[str]:
        args = ["--spec-type", self.spec_type, *self.extra]
        if self.draft is not None:
            args += ["-md", str(self.draft)]
        if self.n_max is not None:
            args += ["--spec-draft-n-max", str(self.n_max)]
        return args


# ngram-simple drafts only when the sequence is longer than n + m + 1 tokens: 1024 + 1024 + 1 never happens below
PLAIN_MAX_CONTEXT = 2048
PLAIN = Setting(
    "plain", "ngram-simple", extra=("--spec-ngram-simple-size-n", "1024", "--spec-ngram-simple-size-m", "1024")
)


@dataclass
class Result:
    name: str
    spec_type: str
    n_max: int | None
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    prompts: list = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second, "acceptance": self.acceptance}


# ggml's CPU thread pools busy-wait for their next graph by default (`--poll 50`). The target's pool then spins
# through the drafter's whole turn, holding cores the drafter's threads need, and the drafter's per-op barriers
# wait on threads that cannot run. `--poll` alone does not reach the batch pool that verifies drafts (several
# tokens) once `-tb` is given, so each pool is named; the draft pools are named for builds that give the drafter one.
NO_POLLING = ("--poll", "0", "--poll-batch", "0", "--poll-draft", "0", "--poll-batch-draft", "0")


def prompt_command(
    binary: Path, target_gguf: Path, prompt: str, setting: Setting, threads: int, max_new_tokens: int, ctx_size: int
) -> list[str]:
    """The `llama-speculative-simple` command line for one greedy generation of `prompt` under `setting`."""
    return [
        str(binary), "-m", str(target_gguf), "-p", prompt, "-n", str(max_new_tokens),
        "-c", str(ctx_size), "--temp", "0", "--seed", "0",
        "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads), *NO_POLLING,
        *setting.arguments(),
    ]  # fmt: skip


def run_prompt(
    binary: Path,
    target_gguf: Path,
    prompt: str,
    setting: Setting,
    threads: int,
    max_new_tokens: int,
    ctx_size: int,
    lock: str = BENCH_LOCK,
    timeout: float = 600,
) -> dict:
    """One greedy generation of `prompt` under `setting`, run holding the benchmark lock (the wait for it is not
    part of `timeout`); its parsed figures."""
    command = prompt_command(binary, target_gguf, prompt, setting, threads, max_new_tokens, ctx_size)
    with bench_lock(lock):
        # the generated text is printed as it comes: a token can end inside a UTF-8 character
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=timeout)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{setting.name}: llama.cpp exited with {done.returncode}:\n{text[-2000:]}")
    return parse_output(text)


def run_settings(
    binary, target_gguf, prompts: list[str], settings: list[Setting], progress: Path | None = None, **options
) -> list[Result]:
    """Every setting on every prompt, prompt by prompt (the settings interleaved, so a change in the machine's load
    falls on all of them alike); the figures summed per setting, and written to `progress` after each prompt."""
    results = [Result(s.name, s.spec_type, s.n_max) for s in settings]
    for i, prompt in enumerate(prompts):
        for setting, result in zip(settings, results, strict=True):
            figures = run_prompt(binary, target_gguf, prompt, setting, **options)
            result.prompts.append(figures)
            result.tokens += figures["tokens"]
            result.seconds += figures["seconds"]
            result.drafted += figures["drafted"]
            result.accepted += figures["accepted"]
        log.info("llama.cpp: prompt %d/%d done", i + 1, len(prompts))
        if progress is not None:
            write_json(progress, {"prompts_done": i + 1, "llamacpp": [r.to_dict() for r in results]})
    for r in results:
        log.info("%-16s %6.1f tok/s  acceptance %s", r.name, r.tokens_per_second, r.acceptance)
    return results
