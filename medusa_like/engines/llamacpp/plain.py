"""llama.cpp's plain decoding as one method of the evaluation table, on the target's own weights and precision.

The evaluation's method (l) (`evaluation/methods.py`) times it beside this framework's methods, interleaved prompt by
prompt. Where llama.cpp is built (`make llamacpp-build`), the target is converted by llama.cpp's own converter
(`convert_hf_to_gguf.py` of the vendored source) in its own precision (f32, bf16 or f16), once per set of weights:
the file is named by the weights' fingerprint (`targets.weights_fingerprint`), so a fine-tuned or replaced target
gets a new file, never an old one. One `llama-server` with a single slot then decodes each prompt's token ids
greedily (the same ids every method gets, no prompt cache), with as many threads as torch uses and ggml's thread
pools as they ship (spinning between graphs: no drafter shares the cores); its wall time per request counts prompt
processing, as every method's does.

    runner = plain_runner(target, tokenizer, eos=[2], threads=2)   # None: not built here (`why_not` says why)
    tokens, _ = runner(ids, 96)                                     # [1, T] in; the new token ids out
"""

import atexit
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from medusa_like.io import exclusive_lock
from medusa_like.targets import weights_fingerprint

from .runner import SERVER, default_cache, executable
from .server import LlamaServer, free_port, server_command

log = logging.getLogger(__name__)

CONVERTER = "convert_hf_to_gguf.py"
OUTTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}  # the converter's --outtype
CONTEXT = 4096  # the one slot's tokens: prompt and answer


def converter(cache: Path) -> Path | None:
    """The vendored llama.cpp's converter inside the unpacked source distribution, if the build's source is there."""
    found = sorted((Path(cache) / "src").glob(f"*/vendor/llama.cpp/{CONVERTER}"))
    return found[-1] if found else None


def why_not(target, cache: Path | None = None) -> str | None:
    """None when llama.cpp's plain decoding can run for `target` here; else why not, in one line."""
    cache = Path(cache or default_cache())
    if target.device.type != "cpu":
        return f"llama.cpp is built for the CPU here, and the target is on {target.device}"
    if target.dtype not in OUTTYPES:
        return f"llama.cpp has no precision for a {target.dtype} target (it converts {list(OUTTYPES)})"
    if not executable(cache, SERVER).is_file() or converter(cache) is None:
        return f"llama.cpp is not built in {cache} (`make llamacpp-build` builds it)"
    if importlib.util.find_spec("sentencepiece") is None:
        return "llama.cpp's converter needs sentencepiece (`make llamacpp-build` installs it)"
    return None


def target_file(target, tokenizer, cache: Path) -> Path:
    """The target as GGUF in its own precision, converted by llama.cpp's converter the first time these weights are
    seen (written beside, then renamed: an interrupted conversion leaves no file that looks finished)."""
    outtype = OUTTYPES[target.dtype]
    out = Path(cache) / "targets" / f"{weights_fingerprint(target)}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(out.with_suffix(".lock"), waiting="another process converts this target"):
        if out.is_file():
            return out
        script = converter(cache)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            model_dir, partial = Path(tmp) / "model", Path(tmp) / out.name
            target.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            log.info("converting the target for llama.cpp (%s, %s) into %s", type(target).__name__, outtype, out)
            env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")}  # the converter's own gguf package
            command = [sys.executable, str(script), str(model_dir), "--outfile", str(partial), "--outtype", outtype]
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0 or not partial.is_file():
                raise RuntimeError(f"llama.cpp's converter failed on the target:\n{done.stderr[-2000:]}")
            partial.replace(out)
    return out


def plain_runner(target, tokenizer, eos: list[int], threads: int | None = None, cache: Path | None = None):
    """A `timing.Runner` for llama.cpp's plain greedy decoding of `target` (its server started on the first call and
    stopped at exit); None where `why_not` gives a reason. The answer stops at the GGUF's end-of-generation tokens,
    and is cut after the first of `eos` as every method's is."""
    cache = Path(cache or default_cache())
    if reason := why_not(target, cache):
        log.info("llama.cpp plain decoding not run: %s", reason)
        return None
    binary, gguf = executable(cache, SERVER), target_file(target, tokenizer, cache)
    threads = threads or torch.get_num_threads()
    server: list[LlamaServer] = []

    def run(ids: torch.Tensor, max_new_tokens: int):
        if ids.shape[-1] + max_new_tokens > CONTEXT:
            raise ValueError(f"a prompt and its answer take {ids.shape[-1] + max_new_tokens} tokens, more than "
                             f"llama.cpp's slot of {CONTEXT}")  # fmt: skip
        if not server:
            port = free_port()
            command = server_command(binary, gguf, None, 1, CONTEXT, threads, port, busy_wait=True)
            server.append(LlamaServer(command, port, cache / "plain_server.log").__enter__())
            atexit.register(server[0].__exit__, None, None, None)
        tokens = server[0].complete(ids[0].tolist(), max_new_tokens)["tokens"]
        ends = [i for i, t in enumerate(tokens) if t in eos]
        return tokens[: ends[0] + 1] if ends else tokens, None

    return run
