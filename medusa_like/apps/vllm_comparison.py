"""vLLM on this CPU beside this framework and llama.cpp: the same target, drafter and prompts, one table.

    make vllm     # this framework's methods (eval.evaluate), llama.cpp (eval.llamacpp), then vLLM (eval.vllm)

For each vLLM setting (plain, our EAGLE-3 export drafting 1-4 tokens, vLLM's n-gram speculation) one engine is started
and measured at three batch sizes: batch 1 is the first `batch1_prompts` prompts one at a time (tokens/s = new tokens
/ generate's wall time, summed over prompts); batch 8 and 32 give vLLM all the prompts in calls of 8 or 32 at once
(throughput = new tokens / wall time). Acceptance per draft position is vLLM's own counter (accepted at position i /
drafts) over the batch-1 run; this framework's for the same drafter and chain is measured on the same prompts. Every
speculative setting's greedy outputs are compared with vLLM's plain ones, and vLLM's plain ones with transformers'
greedy on the same fp32 target. The reports of the evaluation and of llama.cpp, when given, join the table.

Where the time of a speculative step goes, from the same run: tokens per step = 1 + the sum of the acceptance per
position (the bonus token and the accepted drafts), ms per step = tokens per step / tokens/s at batch 1. Against plain
decoding's ms per token, the difference is what drafting k tokens and verifying k + 1 costs.

Needs the vLLM environment (`make vllm-install`; the engine is `engines/vllm/`). `compare_vllm(cfg)` is importable
(with `vllm.profile.batch` > 0 it profiles a step instead: `vllm_step_profile.py`); `main` is the Hydra app behind
`python -m eval.vllm` (conf/vllm.yaml).
"""

import json
import logging
import os
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from medusa_like.apps import CONFIG_DIR
from medusa_like.apps.vllm_step_profile import profile
from medusa_like.engines.run_stamp import batch_entry, machine, stamp
from medusa_like.engines.vllm.driver import VllmEngine, check_export, eagle3, ngram, target_directory
from medusa_like.errors import one_line_errors
from medusa_like.evaluation.setup import question_set, run_dir
from medusa_like.formats import export_drafter, load_drafter
from medusa_like.io import write_json, write_text
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import load_target

log = logging.getLogger(__name__)


def settings(export_dir: Path, run) -> list[tuple[str, dict | None]]:
    """(name, speculative_config) for each vLLM setting of `run` (cfg.vllm), drafting from the export in
    `export_dir`."""
    out = [("vllm plain", None)]
    out += [(f"vllm eagle3 k={k}", eagle3(export_dir, k)) for k in run.eagle3_tokens]
    out += [(f"vllm ngram k={k}", ngram(k)) for k in run.ngram_tokens]
    return out


def measure_engine(engine: VllmEngine, prompts: list[list[int]], batch1: int, batches: list[int], eos, max_tokens):
    """Batch 1 over the first `batch1` prompts (outputs and speculative counters kept), then each batch size over
    all prompts."""
    row = {"startup_seconds": engine.startup_seconds, "outputs": [], "spec": None}
    tokens = seconds = 0.0
    spec = {}
    for ids in prompts[:batch1]:
        out = engine.generate([ids], max_tokens, stop_token_ids=eos)
        row["outputs"].append(out.outputs[0]["token_ids"])
        tokens, seconds = tokens + out.new_tokens, seconds + out.seconds
        spec = {k: _add(spec.get(k), v) for k, v in out.spec.items()}
    row["batch"] = {1: {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}}
    drafts = spec.get("drafts", 0)
    row["spec"] = spec
    row["acceptance_per_position"] = [a / drafts for a in spec["accepted_per_pos"]] if drafts else []
    for size in batches:
        tokens = seconds = 0.0
        for start in range(0, len(prompts), size):
            out = engine.generate(prompts[start : start + size], max_tokens, stop_token_ids=eos)
            tokens, seconds = tokens + out.new_tokens, seconds + out.seconds
        row["batch"][size] = {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}
    return row


def _add(a, b):
    if a is None:
        return b
    if isinstance(b, list):
        return [x + y for x, y in zip(a or [0] * len(b), b, strict=True)]
    return a + b


def acceptance_per_position(accepted_draft: list[int], depth: int) -> list[float]:
    """Per draft position i of a chain of `depth`, as vLLM counts it: the share of steps that accepted at least i + 1
    draft tokens (`accepted_draft`: the draft tokens each step accepted)."""
    steps = max(len(accepted_draft), 1)
    return [sum(n > i for n in accepted_draft) / steps for i in range(depth)]


def framework_chain_acceptance(model, prompt_ids, depths: list[int], max_new_tokens: int) -> dict[int, list[float]]:
    """This framework's acceptance per draft position with the learned drafter drafting a chain of each depth, pooled
    over the prompts (`acceptance_per_position`)."""
    out = {}
    for depth in depths:
        chain = [[0] * (i + 1) for i in range(depth)]
        accepted = []
        for ids in prompt_ids:
            accepted += model.generate(
                ids, max_new_tokens=max_new_tokens, tree=chain, remember=False
            ).stats.accepted_draft
        out[depth] = acceptance_per_position(accepted, depth)
        log.info("framework chain %d: acceptance per position %s", depth, [f"{a:.3f}" for a in out[depth]])
    return out


def transformers_greedy(target, prompt_ids, eos: list[int], max_new_tokens: int) -> list[list[int]]:
    outs = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos[0])  # fmt: skip
        row = out[0, ids.shape[1] :].tolist()
        outs.append(row)
    return outs


def rejoin(cfg) -> dict:
    """The table again from the run directory's vllm.json, joined with the reports `cfg.join` names now (e.g. a
    llama.cpp run made after the vLLM one)."""
    out_dir = run_dir(cfg)
    report = json.loads((out_dir / "vllm.json").read_text())
    report["evaluation"], report["llamacpp"] = _joined(cfg.join.evaluation), _joined(cfg.join.llamacpp)
    write_json(out_dir / "vllm.json", report)
    write_text(out_dir / "vllm.md", markdown(report))
    print(markdown(report))
    return report


def measure(cfg) -> dict:
    if not cfg.vllm.get("measure", True):
        return rejoin(cfg)
    out_dir = run_dir(cfg)
    target, tokenizer = load_target(cfg.model.name_or_path, dtype="float32", device="cpu")
    drafter = load_drafter(cfg.drafter.path, target)
    export = export_drafter(drafter, out_dir / "eagle3", "eagle3", target, cfg.model.name_or_path, overwrite=True)
    check_export(export, target)
    model = MedusaLikeModel(target, tokenizer, drafter, tuned_layers=False)  # nn.Linear, as vLLM's reference
    questions = question_set(cfg.data, cfg.validation)
    prompt_ids = [model.chat_ids([{"role": "user", "content": q.turns[0]}]) for q in questions]
    prompts = [ids[0].tolist() for ids in prompt_ids]
    eos = model.eos_token_ids()
    run = cfg.vllm
    batch1 = min(run.batch1_prompts, len(prompts))
    model_dir = target_directory(target, tokenizer, out_dir)
    load_before = os.getloadavg()
    rows = {}
    for name, spec in settings(export, run):
        engine = VllmEngine(model_dir, speculative=spec, kv_cache_gib=run.kv_cache_gib, seed=cfg.seed)
        with engine:
            rows[name] = measure_engine(engine, prompts, batch1, list(run.batch_sizes), eos, run.max_new_tokens)
        log.info("%s: %s", name, {k: round(v["tokens_per_second"], 1) for k, v in rows[name]["batch"].items()})
        write_json(out_dir / "vllm_partial.json", rows)
    load_after = os.getloadavg()
    plain = rows["vllm plain"]["outputs"]
    for row in rows.values():
        row["equal_to_vllm_plain"] = sum(a == b for a, b in zip(row["outputs"], plain, strict=True))
    torch.set_num_threads(run.threads)
    reference = transformers_greedy(target, prompt_ids[:batch1], eos, run.max_new_tokens)
    framework = framework_chain_acceptance(model, prompt_ids[:batch1], list(run.eagle3_tokens), run.max_new_tokens)
    report = {
        "date": stamp(),
        "machine": machine(),
        "vllm_version": run.version,
        "drafter": str(cfg.drafter.path),
        "prompts": len(prompts),
        "batch1_prompts": batch1,
        "max_new_tokens": run.max_new_tokens,
        "load_average": {"before": load_before, "after": load_after},
        "vllm": {name: {k: v for k, v in row.items() if k != "outputs"} for name, row in rows.items()},
        "vllm_plain_equal_to_transformers_greedy": sum(a == b for a, b in zip(plain, reference, strict=True)),
        "framework_chain_acceptance": framework,
        "evaluation": _joined(cfg.join.evaluation),
        "llamacpp": _joined(cfg.join.llamacpp),
    }
    write_json(out_dir / "vllm.json", report)
    write_text(out_dir / "vllm.md", markdown(report))
    print(markdown(report))
    return report


def _joined(path) -> dict | None:
    if path and Path(path).is_file():
        return json.loads(Path(path).read_text())
    if path:
        log.warning("%s not found: its rows are left out of the table", path)
    return None


def markdown(report: dict) -> str:
    """One table: every engine and method, tokens/s at batch 1 (8 and 32 for the engines), acceptance per position."""
    b1 = report["batch1_prompts"]
    lines = [
        f"{report['machine']}, {report['date']}; {b1} prompts at batch 1, {report['prompts']} at batch 8 and 32, "
        f"{report['max_new_tokens']} new tokens, greedy, fp32 (llama.cpp: its Q4_1 GGUF target); load average "
        f"{report['load_average']['before'][1]:.1f} to {report['load_average']['after'][1]:.1f}",
        "",
        "| engine / method | tokens/s batch 1 | batch 8 | batch 32 | acceptance per position | tokens / step | "
        "ms / step | greedy = plain |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, row in report["vllm"].items():
        b = row["batch"]
        acc = " / ".join(f"{a:.2f}" for a in row["acceptance_per_position"])
        per_step = 1 + sum(row["acceptance_per_position"])  # the bonus token and the accepted drafts
        ms = 1000 * per_step / batch_entry(b, 1)["tokens_per_second"]
        lines.append(
            f"| {name} | {_tps(b, 1)} | {_tps(b, 8)} | {_tps(b, 32)} | {acc} | {per_step:.2f} | {ms:.1f} | "
            f"{row['equal_to_vllm_plain']}/{b1} |"
        )
    llamacpp = report.get("llamacpp") or {}
    batched = {row["name"]: row["batch"] for row in llamacpp.get("batched", [])}
    for row in llamacpp.get("llamacpp", []):
        acc = "" if row["acceptance"] is None else f"{row['acceptance']:.2f} (all positions)"
        b = batched.get(row["name"], {})
        lines.append(
            f"| llama.cpp {row['name']} | {row['tokens_per_second']:.1f} | {_tps(b, 8)} | {_tps(b, 32)} | {acc} | | | "
            f"{_llamacpp_equal(b, llamacpp.get('batched_prompts', 0))} |"
        )
    evaluation = report.get("evaluation")
    for name, tps in _framework_speeds(evaluation).items():
        tau = (evaluation.get("methods", {}).get(name) or {}).get("tau")
        steps = "" if tau is None else f"{tau:.2f}"
        lines.append(f"| medusa_like {name} | {tps:.1f} | | | | {steps} | | |")
    lines += ["", "This framework's acceptance per position, learned drafter drafting the same chains:", ""]
    for depth, acc in report["framework_chain_acceptance"].items():
        lines.append(f"- chain {depth}: " + " / ".join(f"{a:.2f}" for a in acc))
    lines.append(
        f"\nvLLM plain greedy equals transformers' greedy (fp32, same prompts) on "
        f"{report['vllm_plain_equal_to_transformers_greedy']} of {b1} prompts."
    )
    return "\n".join(lines) + "\n"


def _tps(batch: dict, size: int) -> str:
    entry = batch_entry(batch, size)
    return f"{entry['tokens_per_second']:.1f}" if entry else ""


def _llamacpp_equal(batch: dict, prompts: int) -> str:
    """llama-server's answers equal to its own plain ones, per batch size measured."""
    return ", ".join(f"{e['equal_to_plain']}/{prompts} (batch {size})" for size, e in batch.items())


def _framework_speeds(evaluation: dict | None) -> dict[str, float]:
    """Median tokens/s of each method in an evaluation report (`eval.evaluate`'s report.json)."""
    if not evaluation:
        return {}
    return dict(evaluation["speed"]["median_tokens_per_second"])


def compare_vllm(cfg: DictConfig) -> dict:
    """The comparison, or with `vllm.profile.batch` > 0 where a step's time goes instead (`vllm_step_profile.py`)."""
    return profile(cfg) if cfg.vllm.profile.batch else measure(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="vllm")
def main(cfg: DictConfig) -> None:
    with one_line_errors():
        compare_vllm(cfg)
