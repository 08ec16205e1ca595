"""A trained EAGLE-3 drafter served by llama.cpp on the CPU against plain decoding and llama.cpp's lookup modes.

    python -m eval.llamacpp drafter.path=runs/make_run/train/drafter        # or: make llamacpp

Building and running llama.cpp is the llama.cpp engine's (`engines/llamacpp/runner.py`, `server.py`); this app exports the drafter as GGUF in each precision,
runs every setting on the validation prompts and writes the table (llamacpp.json, llamacpp.md). The settings, each
one `llama-speculative-simple` process per prompt, greedy, settings interleaved prompt by prompt:

    plain              --spec-type ngram-simple, its n-gram 1024 + 1024 long    plain decoding in the same executable
    eagle3-<p> d=<n>   --spec-type draft-eagle3 -md drafter.gguf --spec-draft-n-max n    p: f32 | f16 | q8_0
    <ngram mode>       --spec-type ngram-simple | ngram-map-k | ...      llama.cpp's training-free lookup drafting

What llama.cpp prints at the end (`decoded N tokens in S seconds`, `n_drafted`, `n_accept`) is summed over the
first `batch1_prompts` prompts: tokens/s = sum of tokens / sum of decode seconds (prompt processing excluded),
acceptance = accepted draft tokens / drafted tokens. At batch 8 and 32, plain decoding and the f32 drafter at each
chain length run in `llama-server` over all the prompts (`server.py`: throughput with prompt processing
included, as for vLLM). Beside it, this framework's own chain acceptance for the same drafter and prompts (fp32
target, `tree=[[0], [0, 0], ...]`), where acceptance is accepted draft tokens / (steps * depth). Where llama.cpp cannot
be built it says why and exits 0. `compare_llamacpp(cfg)` is importable; `main` is the Hydra app behind
`python -m eval.llamacpp` (conf/llamacpp.yaml).
"""

import logging
import os
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from medusa_like.apps import CONFIG_DIR
from medusa_like.engines.llamacpp.runner import (
    EXECUTABLE,
    PLAIN,
    PLAIN_MAX_CONTEXT,
    SERVER,
    LlamaCppUnavailable,
    Setting,
    bench_lock,
    build,
    run_settings,
)
from medusa_like.engines.llamacpp.server import check_slots, run_batched
from medusa_like.engines.run_stamp import batch_entry, machine, stamp
from medusa_like.errors import one_line_errors
from medusa_like.evaluation.setup import question_set, run_dir
from medusa_like.formats import export_drafter, load_drafter
from medusa_like.formats.gguf import GGUF_FILE, target_gguf
from medusa_like.io import write_json
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import load_target

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# This framework's chain acceptance for the same drafter and prompts


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
    if report.get("batched"):
        sizes = sorted({int(b) for r in report["batched"] for b in r["batch"]})
        lines += [
            "",
            f"llama-server, {report['batched_prompts']} prompts, B requests at once (throughput, tokens/s):",
            "",
        ]
        lines.append("| setting | " + " | ".join(f"batch {b}: tokens/s, acceptance, = plain" for b in sizes) + " |")
        lines.append("|---|" + "---|" * len(sizes))
        for r in report["batched"]:
            cells = []
            for b in sizes:
                e = batch_entry(r["batch"], b)
                acc = "" if e["acceptance"] is None else f"{e['acceptance']:.2f}"
                cells.append(f"{e['tokens_per_second']:.1f}, {acc}, {e['equal_to_plain']}/{report['batched_prompts']}")
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
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


def write_report(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "llamacpp.json", report)
    (out_dir / "llamacpp.md").write_text(markdown(report))
    log.info("wrote %s and %s", out_dir / "llamacpp.json", out_dir / "llamacpp.md")


# ---------------------------------------------------------------------------------------------------------------------
# The whole run (conf/llamacpp.yaml)


def compare_llamacpp(cfg: DictConfig) -> dict | None:
    """Build llama.cpp (or reuse the build), export the drafter in each precision, run every setting on the
    validation prompts, measure this framework's chains; write llamacpp.json / llamacpp.md. None when llama.cpp
    cannot be built here (the reason is logged), or when `build_only` asks for the build alone."""
    run = cfg.llamacpp
    try:
        binary = build(Path(run.cache), run.sdist)
        if run.batch_sizes or cfg.build_only:
            build(Path(run.cache), run.sdist, name=SERVER)
    except LlamaCppUnavailable as err:
        log.warning("llama.cpp run skipped: %s", err)
        return None
    if cfg.build_only:
        log.info("llama.cpp is built in %s: evaluations now time its plain decoding too (method (l))", run.cache)
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
    all_chats = [[{"role": "user", "content": q.turns[0]}] for q in questions]
    chats = all_chats[: run.batch1_prompts]
    texts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    if run.ctx_size > PLAIN_MAX_CONTEXT:
        raise ValueError(f"llamacpp.ctx_size must be at most {PLAIN_MAX_CONTEXT} (plain decoding), got {run.ctx_size}")
    settings = [PLAIN]
    settings += [Setting(f"eagle3-{p} d{n}", "draft-eagle3", drafts[p], n) for p in run.precisions for n in run.chains]
    settings += [Setting(mode, mode) for mode in run.lookup]
    options = dict(threads=run.threads, max_new_tokens=run.max_new_tokens, ctx_size=run.ctx_size)
    torch.set_num_threads(run.threads)
    model = MedusaLikeModel(target, tokenizer, drafter)
    all_ids = [model.chat_ids(chat)[0].tolist() for chat in all_chats]
    if run.batch_sizes:
        check_slots(all_ids, run.max_new_tokens, run.ctx_per_slot)
    load_before = os.getloadavg()
    results = run_settings(binary, target_file, texts, settings, out_dir / "llamacpp_partial.json", **options)
    batched = []
    if run.batch_sizes:
        server = build(Path(run.cache), run.sdist, name=SERVER)
        first = drafts[run.precisions[0]]
        server_settings = [("plain", None)] + [(s.name, s) for s in settings if s.draft == first]
        batched = run_batched(server, target_file, all_ids, server_settings, list(run.batch_sizes), run.threads,
                              run.max_new_tokens, run.ctx_per_slot, out_dir)  # fmt: skip
    load_after = os.getloadavg()
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
        "batched_prompts": len(all_chats),
        "max_new_tokens": run.max_new_tokens,
        "threads": run.threads,
        "load_average": {"before": load_before, "after": load_after},  # the machine's 1/5/15-minute load averages
        "prompt_tokens_match": llama_lengths == [int(ids.shape[-1]) for ids in prompt_ids],
        "llamacpp": [r.to_dict() for r in results],
        "batched": [r.to_dict() for r in batched],
        "framework": framework_chains(model, prompt_ids, list(run.chains), run.max_new_tokens) if run.framework else [],
    }
    write_report(report, out_dir)
    print(markdown(report))
    return report


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="llamacpp")
def main(cfg: DictConfig) -> None:
    with one_line_errors():
        compare_llamacpp(cfg)
