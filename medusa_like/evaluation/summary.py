"""The evaluation report's content, assembled from the per-prompt records of `prompt_loop.run_questions`.

`build_report` makes the dict that report.json holds (summary, setup, definitions, acceptance, head accuracy, speed,
losslessness, tree sweep, per-prompt rows, skipped prompts), then writes report.json, report.md and the plots
(`report`). The definitions follow `medusa_like.evaluation.metrics`.
"""

import platform

import torch
import transformers

from medusa_like.drafters.protocol import sized_by_cost_model
from medusa_like.drafters.registry import kind_of
from medusa_like.evaluation import metrics, precision
from medusa_like.evaluation.losslessness import LOSSLESSNESS, losslessness_section
from medusa_like.evaluation.methods import BASELINES, METHODS, REFERENCE, SPECULATIVE, STOCK, not_run_for
from medusa_like.evaluation.plots import write_plots
from medusa_like.evaluation.report import print_report, write_report
from medusa_like.evaluation.tree_choice import (
    budgeted_candidates,
    depth_topk_accuracy,
    dynamic_candidates,
    predicted_tau,
    time_trees,
    trees_for_budgets,
)

DEFINITIONS = {
    "tau": "generated tokens / target forwards over all prompts; prefill forward and bonus token included",
    "mean_accepted_draft": "draft tokens accepted per tree step, bonus token excluded",
    "acceptance_by_depth": "[d-1]: share of tree steps that accepted at least d draft tokens",
    "draft_ms_per_step": "milliseconds per tree step spent in the drafter proposing the tree",
    "verify_ms_per_step": "milliseconds per tree step spent verifying it: target forward, acceptance, commits",
    "prefill_share": "share of a method's decoding time spent on the prompt's forward, which greedy pays too",
    "tokens_per_second": "new tokens / wall seconds of the whole call (prefill included); median over prompts (a tree "
    "sweep's rows: the geometric mean over the sweep's prompts, as the tree search ranks trees)",
    "speedup": "median tokens/s of the method / median tokens/s of the baseline (paired: median of per-prompt ratios)",
    "batch": "eval.batch_size B > 1: B prompts given to each method at once, this project's loop decoding them as one "
    "batch, the other methods one after another; a prompt's tokens/s is its own new tokens over its own seconds (from "
    "the batch's start to its last token, or its own call), tokens/s in total is every prompt's tokens over the "
    "batches' wall seconds",
    "losslessness": LOSSLESSNESS,
    "stock_equality": "share of prompts whose tokens equal (g)'s, transformers' greedy with its own nn.Linear layers; "
    "a difference fails the run as one from (a) does, and its margin (the reference's token's logit minus the method's "
    "at the first differing token, under the reference's layers) tells a near-tie that other kernels' rounding flipped "
    "(near zero) from a bug (large)",
    "validation_prompts": "data.source=validation: held-out conversations whose first user turn is not a continuation "
    "(a later part of a split conversation, or a short continuation phrase), repeats no earlier one and is asked nowhere "
    "in the training split, and none of whose messages is a training answer (the store's seed); texts compared "
    "casefolded, whitespace collapsed, punctuation stripped at the ends",
    "head_accuracy": "teacher-forced on the reference answers: head k at position t predicts token t+1+k",
}


def acceptance_section(records: list[dict]) -> dict:
    stats = [r[SPECULATIVE]["stats"] for r in records]
    section = metrics.summarize_decode(stats)
    section["histogram"] = metrics.accepted_histogram(stats)
    section["per_category"] = {
        cat: metrics.summarize_decode([r[SPECULATIVE]["stats"] for r in group])
        for cat, group in metrics.group_by(records, "category").items()
    }
    return section


def methods_section(records: list[dict], methods: list[str], speed: dict) -> dict:
    """Every method of this project (the ones with decoding stats): tau, acceptance, ms per step, tokens/s and
    speedups, overall and per category; for a combined tree, the share of accepted tokens each source proposed."""
    section = {}
    for m in methods:
        if records[0][m]["stats"] is None:
            continue
        stats = [r[m]["stats"] for r in records]
        row = metrics.summarize_decode(stats)
        row["tokens_per_second"] = speed["median_tokens_per_second"][m]
        row["speedup"] = {b: speed["speedup"][b][m] for b in BASELINES}
        row["per_category"] = {}
        for cat, group in metrics.group_by(records, "category").items():
            per = metrics.summarize_decode([r[m]["stats"] for r in group])
            ratios = [r[m]["tps"] / r[REFERENCE]["tps"] for r in group]
            per["speedup_vs_hf_greedy"] = metrics.median(ratios)
            row["per_category"][cat] = per
        row["source_share"] = source_share(stats)
        section[m] = row
    return section


def source_share(stats: list[dict]) -> dict:
    """Accepted draft tokens each source proposed / all accepted draft tokens (a token two sources proposed counts for
    both, so shares may add up to more than 1)."""
    accepted = sum(sum(s["accepted_draft"]) for s in stats)
    counts: dict[str, int] = {}
    for s in stats:
        for name, n in s.get("accepted_by_source", {}).items():
            counts[name] = counts.get(name, 0) + n
    return {name: n / max(accepted, 1) for name, n in sorted(counts.items())}


def head_accuracy_section(topk: list[list[float]] | None) -> dict:
    """Drafters whose trees are static (Medusa heads) only: head (depth) k's top-j accuracy."""
    if topk is None:
        return {}
    return {f"head{k + 1}": {f"top{j + 1}": acc for j, acc in enumerate(row)} for k, row in enumerate(topk)}


def prompt_rows(records: list[dict], methods: list[str]) -> list[dict]:
    rows = []
    for r in records:
        spec = r[SPECULATIVE]
        rows.append(
            {
                "question_id": r["question_id"],
                "category": r["category"],
                "turn": r["turn"],
                "prompt_tokens": r["prompt_tokens"],
                "new_tokens": {m: len(r[m]["tokens"]) for m in methods},
                "tokens_per_second": {m: r[m]["tps"] for m in methods},
                "tau": spec["stats"]["tau"],
                "accepted_draft": spec["stats"]["accepted_draft"],
                "match": metrics.outputs_match(spec["tokens"], r[REFERENCE]["tokens"]),
                "match_stock": metrics.outputs_match(spec["tokens"], r[STOCK]["tokens"]) if STOCK in r else None,
            }
        )
    return rows


def sweep_section(model, prompts: list, topk, cfg, main_tree, records: list[dict]) -> list[dict]:
    """tau and tokens/s against tree size on the first prompts: Medusa trees of the sweep budgets (from this run's head
    accuracies) or EAGLE-3's dynamic trees of `tree_search.dynamic`; without a sweep, the main run alone."""
    prompts = prompts[: cfg.eval.sweep.prompts]
    budgeted, static = cfg.tree_search.budgeted, kind_of(model.drafter).static_trees
    if sized_by_cost_model(model.drafter):
        with_learned = "learned" in model.drafter.parts()
        trees = budgeted_candidates(budgeted.learned, budgeted.num_nodes, budgeted.lookup_depth, with_learned)
    elif not static:
        trees = dynamic_candidates(cfg.tree_search.dynamic) if cfg.eval.sweep.prompts else {}
    else:
        trees = trees_for_budgets(topk, list(cfg.eval.sweep.budgets)) if topk is not None else {}
    if not prompts or not trees:
        summary = metrics.summarize_decode([r[SPECULATIVE]["stats"] for r in records])
        tps = metrics.median(r[SPECULATIVE]["tps"] for r in records)
        label = main_tree.max_nodes - 1 if static else main_tree.label
        return [
            {
                "budget": label,
                "nodes": main_tree.max_nodes,
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


def drafter_parameters(model) -> int:
    """Trained parameters of the evaluated drafter (a combined drafter's learned part; lookup has none)."""
    learned = kind_of(model.drafter).learned_part(model.drafter)
    if learned is None:
        return 0
    return sum(p.numel() for m in learned.modules() for p in m.parameters(recurse=False))


def setup_section(
    cfg,
    model,
    tree,
    tree_name: str,
    questions: list,
    methods: list[str],
    prompt_lookup,
    store_filling=None,
    learned_tree=None,
) -> dict:
    """The run's setup; `lookup_store`: how the lookup store was filled before the first prompt, as it happened
    (`evaluation.setup.output_store`), None for a drafter without one; `tree.learned_alone`: the tree the learned
    drafter decoded with alone (`learned_tree`, else the combined tree's learned part): its label and JSON;
    `profile`: the machine profile the target ran as (its file and content hash), None without one; `step`: the
    target's step every method of this project ran on."""
    learned_alone = None
    if "learned" in methods:
        spec = tree.learned_part if learned_tree is None else learned_tree
        learned_alone = {"label": spec.label, **spec.to_json()}
    profile = model.forward.profile
    return {
        "target": str(cfg.model.name_or_path),
        "drafter": None if cfg.drafter.path is None else str(cfg.drafter.path),
        "drafter_kind": model.drafter_kind,
        "drafter_parameters": drafter_parameters(model),
        "tree": {"name": tree_name, "nodes": tree.max_nodes, "depth": tree.max_depth, "learned_alone": learned_alone},
        "lookup_store": store_filling,
        "data": {"source": cfg.data.source, "path": cfg.data.path, "questions": len(questions)},
        "max_new_tokens": cfg.eval.max_new_tokens,
        "prompt_lookup_num_tokens": prompt_lookup,
        "dtype": str(model.target.dtype),
        "drafter_dtype": None if model.drafter_dtype is None else str(model.drafter_dtype),
        "device": str(model.device),
        "backend": model.backend,
        "step": model.forward.describe(),  # `target.compile=auto` alone does not say whether it compiled
        "profile": None if profile is None else {"path": profile.path, "sha256": profile.sha256},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "methods": {name: METHODS[name].description for name in methods},
        "not_run": not_run_for(model, tree, cfg.eval.methods),  # named in eval.methods but not applying here: why
        "cost_models": cost_models_section(model, methods),
    }


def cost_models_section(model, methods: list[str]) -> dict:
    """The cost model each method sized its trees by (lookup and combined drafters: the speculative method, and lookup
    alone), as used, with its source (`file:` a profile, `cache:` or `measured`) and when it was measured; methods
    that consult none are left out."""
    if not sized_by_cost_model(model.drafter):
        return {}
    drafters = {SPECULATIVE: model.drafter, "lookup": model.drafter.parts().get("lookup")}
    used = {name: drafter.cost_model for name, drafter in drafters.items() if name in methods and drafter is not None}
    return {name: cost.to_json() for name, cost in used.items() if cost is not None}


def summary_section(acceptance: dict, speed: dict, lossless: dict, tree: dict) -> dict:
    vs_a = speed["speedup"]["hf_greedy"]
    vs_b = speed["speedup"]["hf_prompt_lookup"]
    return {
        "tau": acceptance["tau"],
        "mean_accepted_draft": acceptance["mean_accepted_draft"],
        "speedup_vs_hf_greedy": vs_a[SPECULATIVE],
        "speedup_vs_hf_prompt_lookup": vs_b[SPECULATIVE],
        "speculative_tokens_per_second": speed["median_tokens_per_second"][SPECULATIVE],
        "draft_ms_per_step": acceptance["draft_ms_per_step"],
        "verify_ms_per_step": acceptance["verify_ms_per_step"],
        "losslessness": lossless["fraction"],
        "lossless": lossless["lossless"],
        "stock_equality": lossless["equality"][SPECULATIVE].get(STOCK),
        "tree_nodes": tree["nodes"],
    }


def teacher_forced_topk(model, records: list[dict], k_max: int) -> list[list[float]]:
    """The top-k accuracy at each depth (Medusa heads'), teacher-forced over the reference's answers."""
    sequences = [
        (torch.cat([torch.tensor(r["prompt_ids"]), torch.tensor(r[REFERENCE]["tokens"])])[None], len(r["prompt_ids"]))
        for r in records
    ]
    return depth_topk_accuracy(model, sequences, k_max)


def build_report(
    cfg,
    model,
    all_records,
    tree,
    tree_name,
    search_result,
    questions,
    out_dir,
    prompt_lookup=None,
    store_filling=None,
    learned_tree=None,
) -> dict:
    """The report (json, markdown, plots) from the per-prompt records; `store_filling` and `learned_tree`:
    `setup_section`'s."""
    skipped = [r for r in all_records if r.get("skipped")]
    records = [r for r in all_records if not r.get("skipped")]
    if not records:
        raise ValueError(f"every prompt was skipped ({len(skipped)}): {skipped[0]['skipped']}")
    topk = None
    if cfg.eval.head_accuracy and kind_of(model.drafter).static_trees:
        topk = teacher_forced_topk(model, records, cfg.eval.k_max)

    methods = [m for m in METHODS if all(m in r for r in records)]  # any subset a run timed, in METHODS' order
    acceptance = acceptance_section(records)
    speed = metrics.speed_summary([{m: r[m]["tps"] for m in methods} for r in records], BASELINES)
    batch = metrics.batch_throughput(records, methods)
    if batch is not None:  # eval.batch_size > 1: each prompt's tokens/s is its own in its batch; the batch's in total
        speed["in_total"] = batch
    lossless = losslessness_section(model, records, methods)
    if precision.wanted(cfg.eval.get("fp32_reference", "auto"), model.target.dtype):
        lossless["fp32"] = precision.fp32_margin_section(cfg.model, model, records, methods, cfg.eval.max_new_tokens)
    setup = setup_section(cfg, model, tree, tree_name, questions, methods, prompt_lookup, store_filling, learned_tree)
    prompts = [torch.tensor(r["prompt_ids"])[None] for r in records]
    report = {
        "summary": summary_section(acceptance, speed, lossless, setup["tree"]),
        "setup": setup,
        "definitions": DEFINITIONS,
        "acceptance": acceptance,
        "head_accuracy": head_accuracy_section(topk),
        "speed": speed,
        "methods": methods_section(records, methods, speed),
        "losslessness": lossless,
        "tree_sweep": sweep_section(model, prompts, topk, cfg, tree, records),
        "tree_search": search_result,
        "prompts": prompt_rows(records, methods),
        "skipped": [{k: r[k] for k in ("question_id", "turn", "prompt_tokens", "skipped")} for r in skipped],
    }
    report["plots"] = write_plots(report, out_dir)
    write_report(report, out_dir)
    print_report(report, out_dir)
    return report
