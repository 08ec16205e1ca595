"""Evaluation: tau, honest speed against strong baselines, and losslessness, on any MT-Bench-form question set.

    python -m eval.evaluate data.path=/path/to/mt_bench_question.jsonl heads.path=runs/<run>/heads
    python -m eval.evaluate data.source=humaneval data.limit=20 heads.path=... tree=trees/h16.json
    python -m eval.evaluate data.source=validation heads.path=... tree=auto eval.max_new_tokens=64

Every turn of every question is one prompt (turn n carries the reference's answers to turns 1..n-1). Per prompt, after
one untimed warm-up pass, four methods run interleaved, in an order rotated from prompt to prompt:

    hf_greedy         (a) transformers `generate`, do_sample=False
    hf_prompt_lookup  (b) transformers prompt-lookup decoding (`prompt_lookup_num_tokens`)
    plain_loop        (c) this project's loop without heads (tree "none": same KV cache and attention backend)
    speculative       (d) this project's speculative decoding with the heads and `tree`

all with the same max_new_tokens and EOS ids. (a) is the reference: (d) must reproduce it token for token. Then the
heads' top-k accuracy is measured teacher-forced over (a)'s answers, and tau / tokens/s are swept over tree sizes.
`report.json`, `report.md` and PNG plots land in the run directory; definitions are in `medusa_like.metrics`.
Exit status 1 when `eval.fail_on_mismatch` and some output differs from (a).
"""

import logging
import platform
import sys
from collections.abc import Callable

import hydra
import torch
import transformers
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from eval.common import load_model, question_set, run_dir, set_threads
from eval.report import print_report, write_markdown, write_plots
from medusa_like import metrics
from medusa_like.questions import Question
from medusa_like.tree import TokenTree, resolve_tree
from medusa_like.tree_search import head_topk_accuracy, predicted_tau, time_call, time_trees, trees_for_budgets

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


def loop_runner(model, tree: TokenTree, max_new_tokens: int, eos: list[int]):
    def run(ids: torch.Tensor):
        out = model.generate(ids, max_new_tokens=max_new_tokens, tree=tree, eos_token_id=eos)
        return out.new_tokens.tolist(), out.stats.as_dict()

    return run


def make_runners(model, tree: TokenTree, cfg: DictConfig) -> dict[str, Callable]:
    eos = model.eos_token_ids()
    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    n = cfg.eval.max_new_tokens
    return {
        "hf_greedy": hf_runner(model.target, n, eos, pad),
        "hf_prompt_lookup": hf_runner(model.target, n, eos, pad, cfg.eval.prompt_lookup_num_tokens),
        "plain_loop": loop_runner(model, resolve_tree("none", model.heads.num_heads), n, eos),
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


def run_questions(model, questions: list[Question], runners: dict, max_turns: int, progress=None) -> list[dict]:
    """Ask every turn of every question; turn n sees the reference's answers to turns 1..n-1."""
    records = []
    for question in questions:
        history: list[dict] = []
        for turn, text in enumerate(question.turns[:max_turns], 1):
            history.append({"role": "user", "content": text})
            ids = model.chat_ids(history)
            result = run_prompt(runners, ids, rotation=len(records))
            reference = result[REFERENCE]["tokens"]
            answer = model.tokenizer.decode(reference, skip_special_tokens=True)
            history.append({"role": "assistant", "content": answer})
            records.append(
                {"question_id": question.question_id, "category": question.category, "turn": turn, "ids": ids, **result}
            )
            if progress is not None:
                progress.update(1)
    return records


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
                "prompt_tokens": r["ids"].shape[1],
                "new_tokens": {m: len(r[m]["tokens"]) for m in METHODS},
                "tokens_per_second": {m: r[m]["tps"] for m in METHODS},
                "tau": spec["stats"]["tau"],
                "accepted_draft": spec["stats"]["accepted_draft"],
                "match": metrics.outputs_match(spec["tokens"], r[REFERENCE]["tokens"]),
            }
        )
    return rows


def sweep_section(model, records, topk, cfg: DictConfig, main_tree: TokenTree) -> list[dict]:
    """tau and tokens/s against tree size: the sweep budgets' trees (from this run's accuracies) and the main tree."""
    prompts = [r["ids"] for r in records[: cfg.eval.sweep.prompts]]
    if not prompts or topk is None or not cfg.eval.sweep.budgets:
        stats = [r["speculative"]["stats"] for r in records]
        tps = metrics.median(r["speculative"]["tps"] for r in records)
        summary = metrics.summarize_decode(stats)
        return [
            {
                "budget": main_tree.num_nodes - 1,
                "nodes": main_tree.num_nodes,
                "depth": main_tree.max_depth,
                "tau": summary["tau"],
                "mean_accepted_draft": summary["mean_accepted_draft"],
                "tokens_per_second": tps,
                "source": "main run",
            }
        ]
    trees = trees_for_budgets(topk, list(cfg.eval.sweep.budgets))
    rows = time_trees(model, prompts, trees, cfg.eval.max_new_tokens, model.eos_token_ids())
    for row in rows:
        row["predicted_tau"] = predicted_tau(trees[row["budget"]], topk)
        row["source"] = f"sweep over {len(prompts)} prompts"
    return rows


def setup_section(cfg: DictConfig, model, tree: TokenTree, tree_name: str, questions: list[Question]) -> dict:
    return {
        "target": str(cfg.model.name_or_path),
        "heads": None if cfg.heads.path is None else str(cfg.heads.path),
        "num_heads": model.heads.num_heads,
        "tree": {"name": tree_name, "nodes": tree.num_nodes, "depth": tree.max_depth},
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
            "plain_loop": "(c) this project's loop without heads (same cache and backend)",
            "speculative": "(d) speculative decoding with the heads",
        },
    }


DEFINITIONS = {
    "tau": "generated tokens / target forwards over all prompts; prefill forward and bonus token included",
    "mean_accepted_draft": "draft tokens accepted per tree step, bonus token excluded",
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
        "losslessness": lossless["fraction"],
        "lossless": lossless["fraction"] == 1.0,
        "tree_nodes": tree["nodes"],
    }


# ---------------------------------------------------------------------------------------------------------------------
# The app


def choose_tree(cfg: DictConfig, model, out_dir) -> tuple[TokenTree, str, dict | None]:
    """The tree of `cfg.tree`; `auto` runs the tree search (calibrate, time budgets, keep the fastest) first."""
    if cfg.tree == "auto":
        from eval.tree_search import search

        result = search(cfg, model, out_dir / "tree.json")
        return resolve_tree(result["path"], model.heads.num_heads), f"auto ({result['path']})", result
    return resolve_tree(cfg.tree, model.heads.num_heads), str(cfg.tree), None


def evaluate(cfg: DictConfig) -> dict:
    """Run the whole evaluation of `cfg` (conf/eval.yaml); write the reports; return report.json's content."""
    set_threads(cfg.eval.threads)
    torch.manual_seed(cfg.seed)
    out_dir = run_dir(cfg)
    model = load_model(cfg)
    questions = question_set(cfg.data, cfg.data.validation)
    tree, tree_name, search_result = choose_tree(cfg, model, out_dir)
    runners = make_runners(model, tree, cfg)

    max_turns = cfg.data.max_turns
    total = sum(min(len(q.turns), max_turns) for q in questions)
    if cfg.eval.warmup:
        warm_up(runners, model.chat_ids([{"role": "user", "content": questions[0].turns[0]}]))
    with tqdm(total=total, desc="prompts", unit="prompt") as bar:
        records = run_questions(model, questions, runners, max_turns, bar)

    topk = None
    if cfg.eval.head_accuracy:
        sequences = [
            (torch.cat([r["ids"][0], torch.tensor(r[REFERENCE]["tokens"])])[None], r["ids"].shape[1]) for r in records
        ]
        topk = head_topk_accuracy(model, sequences, cfg.eval.k_max)

    acceptance = acceptance_section(records)
    speed = metrics.speed_summary([{m: r[m]["tps"] for m in METHODS} for r in records], BASELINES)
    lossless = losslessness_section(records)
    setup = setup_section(cfg, model, tree, tree_name, questions)
    report = {
        "summary": summary_section(acceptance, speed, lossless, setup["tree"]),
        "setup": setup,
        "definitions": DEFINITIONS,
        "acceptance": acceptance,
        "head_accuracy": head_accuracy_section(topk),
        "speed": speed,
        "losslessness": lossless,
        "tree_sweep": sweep_section(model, records, topk, cfg, tree),
        "tree_search": search_result,
        "prompts": prompt_rows(records),
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
    report = evaluate(cfg)
    code = exit_code(report, cfg.eval.fail_on_mismatch)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
