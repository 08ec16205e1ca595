"""Where a vLLM engine step's time goes on this CPU: plain decoding against EAGLE-3 drafting, at one batch size.

    python -m eval.vllm drafter.path=runs/long/train/drafter vllm.profile.batch=8 hydra.run.dir=runs/long/vllm_profile

For plain decoding and each EAGLE-3 setting of `vllm.profile.eagle3_tokens`, one engine is started with vLLM's torch
profiler, warmed up with one unprofiled call, then one call of `batch` prompts is profiled. vLLM's model runner marks
its phases with profiler ranges when `VLLM_CUSTOM_SCOPES_FOR_PROFILING` is set (`gpu_model_runner: preprocess`,
`forward`, `postprocess`, `sample`, `draft`, `bookkeep`; the CPU runner reuses them) and each engine step with an
`execute_context_..._generation_...` range (the draft runs after it, outside); this module counts the steps, sums
each phase's wall time from the trace the profiler writes and divides it by the steps. What generate's wall time per
step holds beyond the phases is the rest: scheduling, vLLM's glue and the hop between its processes.
"""

import gzip
import json
import logging
from collections import defaultdict
from pathlib import Path

from medusa_like.engines.run_stamp import machine, stamp
from medusa_like.engines.vllm.driver import VllmEngine, check_export, eagle3, target_directory
from medusa_like.evaluation.setup import question_set, run_dir
from medusa_like.formats import export_drafter, load_drafter
from medusa_like.io import write_json, write_text
from medusa_like.targets import chat_input_ids, eos_token_ids, load_target

log = logging.getLogger(__name__)

PHASE_PREFIX = "gpu_model_runner: "
PHASES = ("preprocess", "forward", "postprocess", "sample", "draft", "bookkeep")
STEP_PREFIX = "execute_context_"  # one range per engine step


def phase_times(trace_file: Path) -> dict[str, dict]:
    """Per model-runner phase, and for the whole engine step ("step"): total microseconds and count, from a torch
    profiler Chrome trace (.json or .json.gz)."""
    opener = gzip.open if trace_file.suffix == ".gz" else open
    with opener(trace_file, "rt") as f:
        events = json.load(f)["traceEvents"]
    totals = defaultdict(lambda: {"us": 0.0, "count": 0})
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X":
            continue
        phase = (
            name[len(PHASE_PREFIX) :]
            if name.startswith(PHASE_PREFIX)
            else "step"
            if name.startswith(STEP_PREFIX)
            else None
        )
        if phase is not None:
            totals[phase]["us"] += float(event.get("dur", 0.0))
            totals[phase]["count"] += 1
    return dict(totals)


def newest_trace(directory: Path, prefix: str) -> Path:
    traces = sorted(directory.glob(f"{prefix}*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise RuntimeError(f"vLLM's profiler wrote no trace named {prefix}* into {directory}")
    return traces[-1]


def profile(cfg) -> dict:
    """Profile plain decoding and EAGLE-3 at `cfg.vllm.profile.batch`; write profile.json and profile.md."""
    out_dir = run_dir(cfg)
    run = cfg.vllm
    target, tokenizer = load_target(cfg.model.name_or_path, dtype="float32", device="cpu")
    drafter = load_drafter(cfg.drafter.path, target)
    export = export_drafter(drafter, out_dir / "eagle3", "eagle3", target, cfg.model.name_or_path, overwrite=True)
    check_export(export, target)
    questions = question_set(cfg.data, cfg.validation)
    prompts = [chat_input_ids(tokenizer, [{"role": "user", "content": q.turns[0]}])[0].tolist() for q in questions]
    batch = prompts[: run.profile.batch]
    eos = eos_token_ids(target, tokenizer)
    model_dir = target_directory(target, tokenizer, out_dir)
    traces = (out_dir / "traces").resolve()
    settings = [("plain", None)] + [(f"eagle3 k={k}", eagle3(export, k)) for k in run.profile.eagle3_tokens]
    rows = {}
    for name, spec in settings:
        prefix = name.replace(" ", "_").replace("=", "")
        profiler = {"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_with_stack": False}
        engine = VllmEngine(model_dir, speculative=spec, kv_cache_gib=run.kv_cache_gib, profiler_config=profiler,
                            env={"VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1"})  # fmt: skip
        with engine:
            engine.generate(batch, run.max_new_tokens, stop_token_ids=eos)  # warm-up, not profiled
            out = engine.generate(batch, run.max_new_tokens, stop_token_ids=eos, profile=prefix)
        phases = phase_times(newest_trace(traces, prefix))
        steps = phases.get("step", {}).get("count", 0)
        rows[name] = {
            "seconds": out.seconds,
            "new_tokens": out.new_tokens,
            "steps": steps,
            "phases_ms_per_step": {p: v["us"] / 1000 / max(steps, 1) for p, v in phases.items()},
            "ms_per_step": 1000 * out.seconds / max(steps, 1),
            "ms_per_token": 1000 * out.seconds / max(out.new_tokens, 1),
        }
        log.info("%s: %s", name, rows[name])
    report = {"date": stamp(), "machine": machine(), "batch": len(batch), "max_new_tokens": run.max_new_tokens,
              "settings": rows}  # fmt: skip
    write_json(out_dir / "profile.json", report)
    write_text(out_dir / "profile.md", markdown(report))
    print(markdown(report))
    return report


def markdown(report: dict) -> str:
    lines = [
        f"{report['machine']}, {report['date']}; vLLM, batch {report['batch']}, {report['max_new_tokens']} new tokens, "
        "greedy, fp32; ms per engine step by model-runner phase (torch profiler; the profiled call is slower than "
        "an unprofiled one)",
        "",
        "| setting | steps | tokens / step | ms / token | ms / step | " + " | ".join(PHASES) + " | rest |",
        "|---|---:|---:|---:|---:|" + "---:|" * (len(PHASES) + 1),
    ]
    for name, row in report["settings"].items():
        ms = row["phases_ms_per_step"]
        rest = row["ms_per_step"] - sum(ms.get(p, 0.0) for p in PHASES)
        per_step = row["new_tokens"] / max(row["steps"], 1)
        cells = " | ".join(f"{ms.get(p, 0.0):.1f}" for p in PHASES)
        lines.append(
            f"| {name} | {row['steps']} | {per_step:.2f} | {row['ms_per_token']:.1f} | {row['ms_per_step']:.1f} | "
            f"{cells} | {rest:.1f} |"
        )
    return "\n".join(lines) + "\n"
