"""The vLLM engine process: run by the vLLM environment's Python as a script, it imports vLLM and nothing of this package.

vLLM's CPU build pins a transformers older than the one this project is tested on, so it lives in an environment of
its own (`make vllm-install`: `.venv-vllm`); `driver.VllmEngine` starts this file there and talks to it:

    argv[1]   the engine's settings as JSON: `LLM(**settings)` (model directory, dtype, max_model_len,
              speculative_config, ...)
    stdin     one JSON request per line: {"prompts": [[token ids], ...], "sampling": {SamplingParams fields},
              "profile": a trace name prefix, or absent} (profiling needs `profiler_config` in the settings)
    stdout    one JSON answer per request, on a line that starts with MARKER (vLLM's own logs go to stderr):
              {"outputs": [{"token_ids": [...], "finish_reason": "stop" | "length"}], "seconds": generate's wall time,
               "spec": the speculative-decoding counters this request added (drafts, draft tokens, accepted, and
               accepted per draft position)}

The first answer, once the engine is up, is {"ready": true, "startup_seconds": ...}; an error is {"error": "..."}
followed by exit status 1. Token ids in, token ids out: both sides use the tokenizer of the caller.
"""

import json
import os
import sys
import time
import traceback

MARKER = "@medusa_like.vllm@ "
_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


_ANSWERS = sys.stdout  # replaced by a private copy of stdout in main: vLLM and its processes print to stdout too


def answer(message: dict) -> None:
    _ANSWERS.write(MARKER + json.dumps(message) + "\n")
    _ANSWERS.flush()


def spec_counters(llm) -> dict:
    """The engine's cumulative speculative-decoding counters (all zero without a drafter)."""
    counters = {name: 0 for name in _SPEC_COUNTERS.values()} | {"accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in _SPEC_COUNTERS:
            counters[_SPEC_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == _PER_POSITION:
            counters["accepted_per_pos"] = [int(v) for v in metric.values]
    return counters


def difference(after: dict, before: dict) -> dict:
    per_pos_before = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    out = {key: after[key] - before[key] for key in _SPEC_COUNTERS.values()}
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], per_pos_before, strict=True)]
    return out


def serve(settings: dict) -> None:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(**settings)
    answer({"ready": True, "startup_seconds": time.perf_counter() - started})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sampling = request["sampling"]
        seed = sampling.pop("seed", None)
        prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
        # one seed per prompt, derived from the request's: a prompt's sample does not depend on its batch-mates
        params = [SamplingParams(**sampling, seed=None if seed is None else seed + i) for i in range(len(prompts))]
        before = spec_counters(llm)
        if request.get("profile"):
            llm.start_profile(request["profile"])
        started = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        if request.get("profile"):
            llm.stop_profile()  # the profiler's table is written into profiler_config's directory
        outputs = [
            {"token_ids": list(r.outputs[0].token_ids), "finish_reason": r.outputs[0].finish_reason} for r in results
        ]
        answer({"outputs": outputs, "seconds": seconds, "spec": difference(spec_counters(llm), before)})


if __name__ == "__main__":  # vLLM's engine starts worker processes that re-import the main module
    _ANSWERS = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # everything else written to stdout, here and in the engine's processes, goes to stderr
    sys.stdout = sys.stderr
    try:
        serve(json.loads(sys.argv[1]))
    except Exception as err:  # noqa: BLE001 - any failure is reported to the caller, then the process ends
        traceback.print_exc()
        answer({"error": f"{type(err).__name__}: {err}"})
        sys.exit(1)
