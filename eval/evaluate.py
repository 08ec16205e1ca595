"""Evaluation: tau, honest speed against strong baselines, and losslessness, on any MT-Bench-form question set.

    python -m eval.evaluate data.path=/path/to/mt_bench_question.jsonl drafter.path=runs/<run>/drafter
    python -m eval.evaluate data.source=humaneval data.limit=20 drafter.path=... tree=trees/t.json
    python -m eval.evaluate data.source=validation drafter.path=... tree=auto eval.max_new_tokens=64

Every turn of every question is one prompt (turn n carries the reference's answers to turns 1..n-1). Per prompt, after
one untimed warm-up pass, four methods run interleaved, in an order rotated from prompt to prompt:

    hf_greedy         (a) transformers `generate`, do_sample=False
    hf_prompt_lookup  (b) transformers prompt-lookup decoding (`prompt_lookup_num_tokens`)
    plain_loop        (c) this project's loop without a drafter (tree "none": same KV cache and attention backend)
    speculative       (d) this project's speculative decoding with the drafter and `tree`

all with the same max_new_tokens and EOS ids. (a) is the reference: (d) must reproduce it token for token. Each prompt's
result is appended to `prompts.jsonl` as soon as it is measured, so a killed run keeps what it did and continues with
`eval.resume=true`; a prompt too long for the target's context is recorded as skipped. Then Medusa heads' top-k
accuracy is measured teacher-forced over (a)'s answers, and tau / tokens/s are swept over tree sizes. `report.json`,
`report.md` and PNG plots land in the run directory; definitions are in `medusa_like.evaluation.metrics`. Exit status
1 when `eval.fail_on_mismatch` and some output differs from (a).
"""

import json
import logging
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
import transformers
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from medusa_like.cli import EVAL_CHECKS, check_config, one_line_errors
from medusa_like.decoding.generate import tree_size
from medusa_like.evaluation import metrics
from medusa_like.evaluation.questions import Question
from medusa_like.evaluation.report import print_report, write_markdown, write_plots
from medusa_like.evaluation.setup import load_model, question_set, run_dir, run_search, set_threads
from medusa_like.evaluation.tree_search import (
    dynamic_candidates,
    head_topk_accuracy,
    predicted_tau,
    time_call,
    time_trees,
    tree_label,
    trees_for_budgets,
)
from medusa_like.io import read_jsonl

log = logging.getLogger(__name__)

METHODS = ("hf_greedy", "hf_prompt_lookup", "plain_loop", "speculative")
REFERENCE = "hf_greedy"
BASELINES = ("hf_greedy", "hf_prompt_lookup")


# ---------------------------------------------------------------------------------------------------------------------
# The four methods: each maps prompt ids [1, T] to (new token ids, our DecodeStats as a dict or None)


def hf_runner(target, max_new_tokens: int, eos: list[int], pad: int | None, prompt_lookup: int | None = None):
    kwargs = dict(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=pad
    )
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup

    def run(ids: torch.Tensor):
        # an all-ones mask: ids equal to the pad id (random models, EOS-as-pad templates) must not be masked out
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, ids.shape[1] :].tolist(), None

    return run


def loop_runner(model, tree, max_new_tokens: int, eos: list[int]):
    def run(ids: torch.Tensor):
        out = model.generate(ids, max_new_tokens=max_new_tokens, tree=tree, eos_token_id=eos)
        return out.new_tokens.tolist(), out.stats.as_dict()

    run.tree = tree
    return run


def make_runners(model, tree, cfg: DictConfig) -> dict[str, Callable]:
    eos = model.eos_token_ids()
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    n = cfg.eval.max_new_tokens
    return {
        "hf_greedy": hf_runner(model.target, n, eos, pad),
        "hf_prompt_lookup": hf_runner(model.target, n, eos, pad, cfg.eval.prompt_lookup_num_tokens),
        "plain_loop": loop_runner(model, model.resolve_tree("none"), n, eos),
        "speculative": loop_runner(model, tree, n, eos),
    }


# ---------------------------------------------------------------------------------------------------------------------
# The benchmark


def run_prompt(runners: dict[str, Callable], ids: torch.Tensor, rotation: int) -> dict:
    """Every method once on one prompt, in rotated order; tokens, seconds and tokens/s per method."""
    order = list(runners)
    order = order[rotation % len(order) :] + order[: rotation % len(order)]
    result = {}
    for name in order:
        box = {}

        def call(name=name, box=box):
            box["tokens"], box["stats"] = runners[name](ids)
            return len(box["tokens"])

        n, seconds = time_call(call)
        result[name] = {"tokens": box["tokens"], "stats": box["stats"], "seconds": seconds, "tps": n / seconds}
    return result


def run_questions(model, questions: list[Question], runners: dict, cfg: DictConfig, log_path: Path, progress=None):
    """Ask every turn of every question; turn n sees the reference's answers to turns 1..n-1.

    Each prompt's result is appended to `log_path` (JSON Lines) at once; prompts already there are not run again.
    A prompt that does not fit the target's context is recorded as skipped.
    """
    done = {(r["question_id"], r["turn"]): r for r in load_records(log_path)}
    limit = getattr(model.target.config.get_text_config(), "max_position_embeddings", None)
    extra = cfg.eval.max_new_tokens + tree_size(runners["speculative"].tree)
    records = []
    with open(log_path, "a", encoding="utf-8") as log_file:
        for question in questions:
            history: list[dict] = []
            for turn, text in enumerate(question.turns[: cfg.data.max_turns], 1):
                history.append({"role": "user", "content": text})
                key = (question.question_id, turn)
                if key in done:
                    record = done[key]
                else:
                    record = run_one(model, runners, history, question, turn, len(records), limit, extra)
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                records.append(record)
                if record.get("skipped"):
                    break  # later turns would need this turn's answer
                answer = model.tokenizer.decode(record[REFERENCE]["tokens"], skip_special_tokens=True)
                history.append({"role": "assistant", "content": answer})
                if progress is not None:
                    progress.update(1)
    return records


def run_one(model, runners, history, question, turn: int, rotation: int, limit: int | None, extra: int) -> dict:
    """One prompt through every method; a prompt that cannot fit the target's context is recorded as skipped."""
    ids = model.chat_ids(history)
    base = {
        "question_id": question.question_id,
        "category": question.category,
        "turn": turn,
        "prompt_tokens": ids.shape[1],
    }
    if limit is not None and ids.shape[1] + extra > limit:
        reason = f"prompt of {ids.shape[1]} tokens + {extra} new/tree tokens exceeds the target's context of {limit}"
        log.warning("question %s turn %d skipped: %s", question.question_id, turn, reason)
        return {**base, "skipped": reason}
    return {**base, "prompt_ids": ids[0].tolist(), **run_prompt(runners, ids, rotation)}


def load_records(path: Path) -> list[dict]:
    """The prompts a previous (killed) run of this directory finished, from its prompts.jsonl. A last line that the
    kill cut short is removed from the file (its prompt runs again); every complete line must be a record."""
    if not path.exists():
        return []
    text = path.read_bytes()
    complete = text[: text.rfind(b"\n") + 1]
    if len(complete) < len(text):
        log.warning(
            "%s: dropping an incomplete last line (%d bytes) left by a killed run", path, len(text) - len(complete)
        )
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    return [record for _, record in read_jsonl(path)]


def warm_up(runners: dict, ids: torch.Tensor) -> None:
    for run in runners.values():
        run(ids)


# ---------------------------------------------------------------------------------------------------------------------
# Pieces of the report


def acceptance_section(records: list[dict]) -> dict:
    stats = [r["speculative"]["stats"] for r in records]
    section = metrics.summarize_decode(stats)
    section["histogram"] = metrics.accepted_histogram(stats)
    section["per_category"] = {
        cat: metrics.summarize_decode([r["speculative"]["stats"] for r in group])
        for cat, group in metrics.group_by(records, "category").items()
    }
    return section


def losslessness_section(records: list[dict]) -> dict:
    pairs = [(r["speculative"]["tokens"], r[REFERENCE]["tokens"]) for r in records]
    section = metrics.losslessness(pairs)
    section["mismatched"] = [
        {"question_id": records[i]["question_id"], "turn": records[i]["turn"], "first_divergence": d}
        for i, d in zip(section.pop("mismatch_index"), section.pop("first_divergence"), strict=True)
    ]
    section["definition"] = "speculative tokens == transformers greedy tokens: same length, equal token for token"
    return section


def head_accuracy_section(topk: list[list[float]] | None) -> dict:
    """Medusa heads only: head k's top-j accuracy."""
    if topk is None:
        return {}
    return {f"head{k + 1}": {f"top{j + 1}": acc for j, acc in enumerate(row)} for k, row in enumerate(topk)}


def prompt_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        spec = r["speculative"]
        rows.append(
            {
                "question_id": r["question_id"],
                "category": r["category"],
                "turn": r["turn"],
                "prompt_tokens": r["prompt_tokens"],
                "new_tokens": {m: len(r[m]["tokens"]) for m in METHODS},
                "tokens_per_second": {m: r[m]["tps"] for m in METHODS},
                "tau": spec["stats"]["tau"],
                "accepted_draft": spec["stats"]["accepted_draft"],
                "match": metrics.outputs_match(spec["tokens"], r[REFERENCE]["tokens"]),
            }
        )
    return rows


def sweep_section(model, prompts: list, topk, cfg: DictConfig, main_tree, records: list[dict]) -> list[dict]:
    """tau and tokens/s against tree size on the first prompts: Medusa trees of the sweep budgets (from this run's head
    accuracies) or EAGLE-3's dynamic trees of `tree_search.dynamic`; without a sweep, the main run alone."""
    prompts = prompts[: cfg.eval.sweep.prompts]
    if model.max_depth is None:
        trees = dynamic_candidates(cfg.tree_search.dynamic) if cfg.eval.sweep.prompts else {}
    else:
        trees = trees_for_budgets(topk, list(cfg.eval.sweep.budgets)) if topk is not None else {}
    if not prompts or not trees:
        summary = metrics.summarize_decode([r["speculative"]["stats"] for r in records])
        tps = metrics.median(r["speculative"]["tps"] for r in records)
        label = tree_label(main_tree) if model.max_depth is None else tree_size(main_tree) - 1
        return [
            {
                "budget": label,
                "nodes": tree_size(main_tree),
                "depth": main_tree.max_depth,
                "tau": summary["tau"],
                "mean_accepted_draft": summary["mean_accepted_draft"],
                "tokens_per_second": tps,
                "source": "main run",
            }
        ]
    rows = time_trees(model, prompts, trees, cfg.eval.max_new_tokens, model.eos_token_ids())
    for row in rows:
        if topk is not None:
            row["predicted_tau"] = predicted_tau(trees[row["budget"]], topk)
        row["source"] = f"sweep over {len(prompts)} prompts"
    return rows


def setup_section(cfg: DictConfig, model, tree, tree_name: str, questions: list[Question]) -> dict:
    return {
        "target": str(cfg.model.name_or_path),
        "drafter": None if cfg.drafter.path is None else str(cfg.drafter.path),
        "drafter_kind": model.drafter_kind,
        "drafter_parameters": sum(p.numel() for p in model.drafter.parameters()),
        "tree": {"name": tree_name, "nodes": tree_size(tree), "depth": tree.max_depth},
        "data": {"source": cfg.data.source, "path": cfg.data.path, "questions": len(questions)},
        "max_new_tokens": cfg.eval.max_new_tokens,
        "prompt_lookup_num_tokens": cfg.eval.prompt_lookup_num_tokens,
        "dtype": str(model.target.dtype),
        "device": str(model.device),
        "backend": model.backend,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "methods": {
            "hf_greedy": "(a) transformers generate, greedy: the reference",
            "hf_prompt_lookup": "(b) transformers prompt-lookup decoding",
            "plain_loop": "(c) this project's loop without a drafter (same cache and backend)",
            "speculative": "(d) speculative decoding with the drafter",
        },
    }


DEFINITIONS = {
    "tau": "generated tokens / target forwards over all prompts; prefill forward and bonus token included",
    "mean_accepted_draft": "draft tokens accepted per tree step, bonus token excluded",
    "acceptance_by_depth": "[d-1]: share of tree steps that accepted at least d draft tokens",
    "draft_ms_per_step": "milliseconds per tree step spent in the drafter proposing the tree",
    "verify_ms_per_step": "milliseconds per tree step spent verifying it: target forward, acceptance, commits",
    "tokens_per_second": "new tokens / wall seconds of the whole call (prefill included); median over prompts",
    "speedup": "median tokens/s of the method / median tokens/s of the baseline (paired: median of per-prompt ratios)",
    "losslessness": "share of prompts whose speculative tokens equal transformers' greedy tokens, same length",
    "head_accuracy": "teacher-forced on the reference answers: head k at position t predicts token t+1+k",
}


def summary_section(acceptance: dict, speed: dict, lossless: dict, tree: dict) -> dict:
    vs_a = speed["speedup"]["hf_greedy"]
    vs_b = speed["speedup"]["hf_prompt_lookup"]
    return {
        "tau": acceptance["tau"],
        "mean_accepted_draft": acceptance["mean_accepted_draft"],
        "speedup_vs_hf_greedy": vs_a["speculative"],
        "speedup_vs_hf_prompt_lookup": vs_b["speculative"],
        "speculative_tokens_per_second": speed["median_tokens_per_second"]["speculative"],
        "draft_ms_per_step": acceptance["draft_ms_per_step"],
        "verify_ms_per_step": acceptance["verify_ms_per_step"],
        "losslessness": lossless["fraction"],
        "lossless": lossless["fraction"] == 1.0,
        "tree_nodes": tree["nodes"],
    }


# ---------------------------------------------------------------------------------------------------------------------
# The app


def choose_tree(cfg: DictConfig, model, out_dir) -> tuple[object, str, dict | None]:
    """The tree of `cfg.tree`; `auto` runs the tree search (calibrate, time, keep the fastest) first."""
    if cfg.tree == "auto":
        result = run_search(cfg, model, out_dir / "tree.json")
        return model.resolve_tree(result["path"]), f"auto ({result['path']})", jsonable(result)
    tree = OmegaConf.to_container(cfg.tree) if OmegaConf.is_config(cfg.tree) else cfg.tree
    return model.resolve_tree(tree), str(tree), None


def jsonable(result: dict) -> dict:
    spec = result["spec"]
    spec = vars(spec) if hasattr(spec, "depth") and not isinstance(spec, list) else [list(p) for p in spec]
    return {**result, "spec": spec}


def evaluate(cfg: DictConfig) -> dict:
    """Run the whole evaluation of `cfg` (conf/eval.yaml); write the reports; return report.json's content."""
    check_config(cfg, EVAL_CHECKS)
    set_threads(cfg.eval.threads)
    torch.manual_seed(cfg.seed)
    out_dir = run_dir(cfg)
    log_path = out_dir / "prompts.jsonl"
    if log_path.exists() and not cfg.eval.resume:
        raise FileExistsError(f"{log_path} exists: continue that run with eval.resume=true, or use another out_dir")
    model = load_model(cfg)
    questions = question_set(cfg.data, cfg.validation)
    tree, tree_name, search_result = choose_tree(cfg, model, out_dir)
    runners = make_runners(model, tree, cfg)

    total = sum(min(len(q.turns), cfg.data.max_turns) for q in questions)
    if cfg.eval.warmup:
        warm_up(runners, model.chat_ids([{"role": "user", "content": questions[0].turns[0]}]))
    with tqdm(total=total, desc="prompts", unit="prompt") as bar:
        records = run_questions(model, questions, runners, cfg, log_path, bar)
    return build_report(cfg, model, records, tree, tree_name, search_result, questions, out_dir)


def build_report(cfg, model, all_records, tree, tree_name, search_result, questions, out_dir) -> dict:
    """The report (json, markdown, plots) from the per-prompt records."""
    skipped = [r for r in all_records if r.get("skipped")]
    records = [r for r in all_records if not r.get("skipped")]
    if not records:
        raise ValueError(f"every prompt was skipped ({len(skipped)}): {skipped[0]['skipped']}")
    topk = None
    if cfg.eval.head_accuracy and model.max_depth is not None:
        sequences = [
            (
                torch.cat([torch.tensor(r["prompt_ids"]), torch.tensor(r[REFERENCE]["tokens"])])[None],
                len(r["prompt_ids"]),
            )
            for r in records
        ]
        topk = head_topk_accuracy(model, sequences, cfg.eval.k_max)

    acceptance = acceptance_section(records)
    speed = metrics.speed_summary([{m: r[m]["tps"] for m in METHODS} for r in records], BASELINES)
    lossless = losslessness_section(records)
    setup = setup_section(cfg, model, tree, tree_name, questions)
    prompts = [torch.tensor(r["prompt_ids"])[None] for r in records]
    report = {
        "summary": summary_section(acceptance, speed, lossless, setup["tree"]),
        "setup": setup,
        "definitions": DEFINITIONS,
        "acceptance": acceptance,
        "head_accuracy": head_accuracy_section(topk),
        "speed": speed,
        "losslessness": lossless,
        "tree_sweep": sweep_section(model, prompts, topk, cfg, tree, records),
        "tree_search": search_result,
        "prompts": prompt_rows(records),
        "skipped": [{k: r[k] for k in ("question_id", "turn", "prompt_tokens", "skipped")} for r in skipped],
    }
    report["plots"] = write_plots(report, out_dir)
    write_markdown(report, out_dir)
    print_report(report, out_dir)
    return report


def exit_code(report: dict, fail_on_mismatch: bool) -> int:
    return 1 if fail_on_mismatch and not report["summary"]["lossless"] else 0


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    log.info("config:\n%s", OmegaConf.to_yaml(cfg))
    with one_line_errors():
        report = evaluate(cfg)
    code = exit_code(report, cfg.eval.fail_on_mismatch)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
