"""llama.cpp at batch 8 and 32: its server (`llama-server`) with one slot per concurrent request.

`llama-speculative-simple` decodes one sequence; llama.cpp batches several only in its server, which drafts per
slot (EAGLE-3 or n-gram) and verifies every slot's drafts in one target batch. For each setting one server is
started with `-np` = the largest batch size and the prompts are sent in groups of B at once, as the vLLM benchmark
calls `generate` with B prompts: throughput = new tokens / wall time from the first request to the last answer
(prompt processing included, as for vLLM). Requests carry the token ids of the chat-templated prompts, greedy
(`temperature` 0), stopping at the end-of-sequence token or after `max_new_tokens`, without the server's prompt cache.

The server reports per answer the drafted and accepted draft tokens (`timings.draft_n`, `draft_n_accepted`) and the
token ids (`return_tokens`), so acceptance and equality with plain decoding come from the same run.
"""

import json
import logging
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .runner import NO_POLLING, Setting, bench_lock

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(binary: Path, target_gguf: Path, setting: Setting | None, slots: int, ctx_per_slot: int,
                   threads: int, port: int, busy_wait: bool = False) -> list[str]:  # fmt: skip
    """`llama-server` with `slots` parallel slots of `ctx_per_slot` tokens each; `setting` None: plain decoding.
    `busy_wait`: ggml's default thread pools, which spin between graphs (`NO_POLLING` says why a drafter's run must
    not); for plain decoding alone they are llama.cpp as it ships, and a few percent faster."""
    command = [
        str(binary), "-m", str(target_gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(slots * ctx_per_slot), "--kv-unified",
        "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads),
        *(() if busy_wait else NO_POLLING), "--no-warmup", "--seed", "0",
    ]  # fmt: skip
    return command if setting is None else command + setting.arguments()


@dataclass
class BatchedResult:
    name: str
    batches: dict = field(default_factory=dict)  # batch size -> tokens, seconds, tokens_per_second, drafted, accepted
    outputs: dict = field(default_factory=dict)  # batch size -> token ids per prompt

    def to_dict(self) -> dict:
        return {"name": self.name, "batch": self.batches}


class LlamaServer:
    """One `llama-server` process for the length of a `with` block."""

    def __init__(self, command: list[str], port: int, log_path: Path):
        self.command, self.port, self.log_path = command, port, log_path

    def __enter__(self):
        self.log_file = self.log_path.open("w")
        self.process = subprocess.Popen(self.command, stdout=self.log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server not ready after {STARTUP_TIMEOUT_S} s; see {self.log_path}")

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log_file.close()

    def complete(self, prompt: list[int], max_new_tokens: int) -> dict:
        body = {
            "prompt": prompt, "n_predict": max_new_tokens, "temperature": 0, "seed": 0,
            "return_tokens": True, "cache_prompt": False, "stream": False,
        }  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=3600) as answer:
            return json.loads(answer.read())

    def complete_all(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[dict], float]:
        """All `prompts` sent at once (one thread each); the answers in order and the wall seconds."""
        answers: list[dict | BaseException | None] = [None] * len(prompts)

        def one(i):
            try:
                answers[i] = self.complete(prompts[i], max_new_tokens)
            except BaseException as err:  # re-raised below, in the calling thread
                answers[i] = err

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        for a in answers:
            if isinstance(a, BaseException):
                raise RuntimeError(f"llama-server request failed: {a}") from a
        return answers, seconds


def check_slots(prompts: list[list[int]], max_new_tokens: int, ctx_per_slot: int) -> None:
    """Refuse, before anything runs, prompts whose answers would not fit a server slot."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > ctx_per_slot:
        raise ValueError(
            f"a prompt and its answer take {longest} tokens, more than a slot's {ctx_per_slot} (llamacpp.ctx_per_slot)"
        )


def run_batched(binary: Path, target_gguf: Path, prompts: list[list[int]], settings: list[tuple[str, Setting | None]],
                batch_sizes: list[int], threads: int, max_new_tokens: int, ctx_per_slot: int,
                log_dir: Path) -> list[BatchedResult]:  # fmt: skip
    """Every setting at every batch size over all `prompts` (groups of B sent at once), holding the benchmark lock."""
    results = []
    check_slots(prompts, max_new_tokens, ctx_per_slot)
    slots = max(batch_sizes)
    for name, setting in settings:
        port = free_port()
        command = server_command(binary, target_gguf, setting, slots, ctx_per_slot, threads, port)
        result = BatchedResult(name)
        log_path = log_dir / f"server_{name.replace(' ', '_')}.log"
        with bench_lock(), LlamaServer(command, port, log_path) as server:
            server.complete(prompts[0][:8], 4)  # warm-up: the first graphs are built outside the timing
            for size in batch_sizes:
                tokens = seconds = drafted = accepted = 0
                outputs = []
                for start in range(0, len(prompts), size):
                    answers, wall = server.complete_all(prompts[start : start + size], max_new_tokens)
                    seconds += wall
                    for a in answers:
                        tokens += a["tokens_predicted"]
                        drafted += a["timings"].get("draft_n", 0)
                        accepted += a["timings"].get("draft_n_accepted", 0)
                        outputs.append(a["tokens"])
                result.batches[size] = {
                    "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                    "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
                }  # fmt: skip
                result.outputs[size] = outputs
                log.info("llama-server %s batch %d: %.1f tok/s", name, size, tokens / seconds)
        results.append(result)
    plain = results[0].outputs
    for result in results:
        for size, outs in result.outputs.items():
            result.batches[size]["equal_to_plain"] = sum(a == b for a, b in zip(outs, plain[size], strict=True))
    return results
