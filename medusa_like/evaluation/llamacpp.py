"""A trained EAGLE-3 drafter served by llama.cpp on the CPU: build llama.cpp, run it, parse what it prints.

    python -m eval.llamacpp drafter.path=runs/make_run/train/drafter        # or: make llamacpp

llama.cpp comes from a source distribution on PyPI (`llama-cpp-python` vendors it, EAGLE-3 included), downloaded
with pip, built CPU-only with cmake/ninja for the one executable needed (`llama-speculative-simple`) into
`.llamacpp/` (git-ignored); a second run reuses the build. Nothing from llama.cpp is committed or imported.

`--spec-type none` makes this version's `llama-speculative-simple` exit ("failed to initialize speculative
decoding": it builds no drafter), and `llama-simple` takes no thread count, so plain decoding is `ngram-simple` with
the longest n-gram and m-gram it accepts: it drafts nothing while the sequence is under 2,049 tokens (`ctx_size`
stays at most 2,048), and each step verifies one token, exactly plain decoding.

Every run is one `llama-speculative-simple` process per prompt, greedy (`--temp 0`), the same number of threads for
the target and the drafter, holding the lock `flock /tmp/medusa_bench.lock` takes, so no two benchmarks overlap:

    plain              --spec-type ngram-simple, its n-gram 1024 + 1024 long    plain decoding in the same executable
    eagle3-<p> d=<n>   --spec-type draft-eagle3 -md drafter.gguf --spec-draft-n-max n    p: f32 | f16 | q8_0
    <ngram mode>       --spec-type ngram-simple | ngram-map-k | ...      llama.cpp's training-free lookup drafting

What llama.cpp prints at the end (`decoded N tokens in S seconds`, `n_drafted`, `n_accept`) is summed over the
prompts: tokens/s = sum of tokens / sum of decode seconds (prompt processing excluded), acceptance = accepted draft
tokens / drafted tokens. Beside it, this framework's own chain acceptance for the same drafter and prompts (fp32
target, `tree=[[0], [0, 0], ...]`), where acceptance is accepted draft tokens / (steps * depth).
"""

import fcntl
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from medusa_like.io import write_json

log = logging.getLogger(__name__)

EXECUTABLE = "llama-speculative-simple"
BENCH_LOCK = "/tmp/medusa_bench.lock"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this CPU's instruction set: the build is for this machine only
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_OPENSSL=OFF",
)


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be built or run here (no build tools, no network to PyPI, no build yet)."""


# ---------------------------------------------------------------------------------------------------------------------
# Build


def executable(cache: Path) -> Path:
    return Path(cache) / "build" / "bin" / EXECUTABLE


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


def build(cache: Path, sdist: str, jobs: int = 2) -> Path:
    """The llama-speculative-simple executable, built once into `cache/build` (a second call only checks it)."""
    binary = executable(cache)
    if binary.is_file():
        return binary
    missing = [tool for tool in ("cmake", "ninja", "g++") if shutil.which(tool) is None]
    if missing:
        raise LlamaCppUnavailable(f"building llama.cpp needs {missing} on PATH")
    source = source_dir(cache, sdist)
    build_dir, log_path = Path(cache) / "build", Path(cache) / "build.log"
    steps = (
        ["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *CMAKE_OPTIONS],
        ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", EXECUTABLE],
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
    command = [
        str(binary), "-m", str(target_gguf), "-p", prompt, "-n", str(max_new_tokens),
        "-c", str(ctx_size), "--temp", "0", "--seed", "0",
        "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads),
        *setting.arguments(),
    ]  # fmt: skip
    with bench_lock(lock):
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
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


# ---------------------------------------------------------------------------------------------------------------------
# This framework's chain acceptance for the same drafter and prompts


@contextmanager
def bench_lock(path: str = BENCH_LOCK):
    """The same lock `flock` takes: held while this process times anything."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def framework_chains(model, prompt_ids: list, chains: list[int], max_new_tokens: int) -> list[dict]:
    """Per chain depth d: accepted draft tokens / (steps * d), mean accepted per step, tokens/s (fp32 target)."""
    rows = []
    for depth in chains:
        tree = [[0] * n for n in range(1, depth + 1)]
        accepted = steps = tokens = 0
        seconds = 0.0
        with bench_lock():
            for ids in prompt_ids:
                out = model.generate(ids, max_new_tokens=max_new_tokens, tree=tree, remember=False)
                accepted += sum(out.stats.accepted_draft)
                steps += len(out.stats.accepted_draft)
                tokens += out.stats.new_tokens
                seconds += out.stats.decode_seconds
        rows.append(
            {
                "depth": depth,
                "acceptance": accepted / max(steps * depth, 1),
                "mean_accepted": accepted / max(steps, 1),
                "tokens_per_second": tokens / seconds if seconds else 0.0,
            }
        )
        log.info("framework chain %d: acceptance %.3f", depth, rows[-1]["acceptance"])
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Report


def markdown(report: dict) -> str:
    plain = next((r for r in report["llamacpp"] if r["name"] == PLAIN.name), None)
    base = plain["tokens_per_second"] if plain else None
    lines = [
        f"llama.cpp ({report['llamacpp_source']}, {EXECUTABLE}), target {report['target_gguf_name']}, "
        f"{report['prompts']} prompts, {report['max_new_tokens']} new tokens, greedy, {report['threads']} threads; "
        f"machine: {report['machine']}, load average {report['load_average']['before'][1]:.1f} to "
        f"{report['load_average']['after'][1]:.1f} (5 min)",
        "",
        "| setting | draft n-max | acceptance | tokens/s | speed-up |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in report["llamacpp"]:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        speed = f"{r['tokens_per_second'] / base:.2f}x" if base else ""
        n_max = "" if r["n_max"] is None else str(r["n_max"])
        lines.append(f"| {r['name']} | {n_max} | {acc} | {r['tokens_per_second']:.1f} | {speed} |")
    if report.get("framework"):
        lines += [
            "",
            "This framework, same drafter and prompts, fp32 target, chain trees:",
            "",
            "| chain depth | acceptance | mean accepted / step | tokens/s |",
            "|---:|---:|---:|---:|",
        ]
        for r in report["framework"]:
            lines.append(
                f"| {r['depth']} | {r['acceptance']:.3f} | {r['mean_accepted']:.2f} | {r['tokens_per_second']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def machine() -> str:
    """`lscpu`'s model name and the cores this process may use."""
    name = "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def write_report(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "llamacpp.json", report)
    (out_dir / "llamacpp.md").write_text(markdown(report))
    log.info("wrote %s and %s", out_dir / "llamacpp.json", out_dir / "llamacpp.md")


def stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


# ---------------------------------------------------------------------------------------------------------------------
# The whole run (conf/llamacpp.yaml)


def measure(cfg) -> dict | None:
    """Build llama.cpp (or reuse the build), export the drafter in each precision, run every setting on the
    validation prompts, measure this framework's chains; write llamacpp.json / llamacpp.md. None when llama.cpp
    cannot be built here (the reason is logged)."""
    import torch

    from medusa_like.evaluation.setup import question_set, run_dir
    from medusa_like.formats import export_drafter, load_drafter
    from medusa_like.formats.gguf import GGUF_FILE, target_gguf
    from medusa_like.model import MedusaLikeModel
    from medusa_like.targets import load_target

    run = cfg.llamacpp
    try:
        binary = build(Path(run.cache), run.sdist)
    except LlamaCppUnavailable as err:
        log.warning("llama.cpp run skipped: %s", err)
        return None
    out_dir = run_dir(cfg)
    target, tokenizer = load_target(cfg.model.name_or_path, dtype="float32", device="cpu")
    drafter = load_drafter(cfg.drafter.path, target)
    target_file = target_gguf(cfg.model.name_or_path)
    drafts = {
        p: export_drafter(
            drafter, out_dir / f"gguf_{p}", "gguf", target, cfg.model.name_or_path, dtype=p, overwrite=True
        )
        / GGUF_FILE
        for p in run.precisions
    }
    questions = question_set(cfg.data, cfg.validation)
    chats = [[{"role": "user", "content": q.turns[0]}] for q in questions]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    if run.ctx_size > PLAIN_MAX_CONTEXT:
        raise ValueError(f"llamacpp.ctx_size must be at most {PLAIN_MAX_CONTEXT} (plain decoding), got {run.ctx_size}")
    settings = [PLAIN]
    settings += [Setting(f"eagle3-{p} d{n}", "draft-eagle3", drafts[p], n) for p in run.precisions for n in run.chains]
    settings += [Setting(mode, mode) for mode in run.lookup]
    options = dict(threads=run.threads, max_new_tokens=run.max_new_tokens, ctx_size=run.ctx_size)
    load_before = os.getloadavg()
    results = run_settings(binary, target_file, texts, settings, out_dir / "llamacpp_partial.json", **options)
    load_after = os.getloadavg()
    torch.set_num_threads(run.threads)
    model = MedusaLikeModel(target, tokenizer, drafter)
    prompt_ids = [model.chat_ids(chat) for chat in chats]
    llama_lengths = [p["prompt_tokens"] for p in results[0].prompts]
    report = {
        "date": stamp(),
        "machine": machine(),
        "llamacpp_source": run.sdist,
        "target_gguf_name": target_file.name,
        "drafter": str(cfg.drafter.path),
        "draft_files": {p: {"path": str(f), "bytes": f.stat().st_size} for p, f in drafts.items()},
        "prompts": len(texts),
        "max_new_tokens": run.max_new_tokens,
        "threads": run.threads,
        "load_average": {"before": load_before, "after": load_after},  # the machine's 1/5/15-minute load averages
        "prompt_tokens_match": llama_lengths == [int(ids.shape[-1]) for ids in prompt_ids],
        "llamacpp": [r.to_dict() for r in results],
        "framework": framework_chains(model, prompt_ids, list(run.chains), run.max_new_tokens) if run.framework else [],
    }
    write_report(report, out_dir)
    print(markdown(report))
    return report
