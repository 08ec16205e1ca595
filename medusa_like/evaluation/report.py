"""Rendering an evaluation report: report.json, report.md and a rich console table (its plots: `plots.py`).

The report is the dict built by `medusa_like.evaluation.summary.build_report`; nothing here measures anything. A method
of this project whose outputs differ from a reference greedy run, (a) or (g), opens report.md and the console output
with a red warning (`lossless_report.py`: that warning, the equality tables, and `failure_line`, the one line the
evaluation command writes to stderr then).
"""

from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from medusa_like.evaluation.lossless_report import (
    equality_markdown,
    fp32_markdown,
    markdown_table,
    mismatch_warning,
    share_text,
)
from medusa_like.evaluation.methods import label
from medusa_like.io import write_json, write_text

# ---------------------------------------------------------------------------------------------------------------------
# Files


def write_report_json(report: dict, out_dir: Path) -> Path:
    return write_json(out_dir / "report.json", report)


def methods_markdown(report: dict) -> list[str]:
    """This project's methods side by side (tau, ms per step, speedups), per category, and the sources' shares."""
    methods = report.get("methods") or {}
    if not methods:
        return []
    parts = ["## This project's methods on the same prompts"]
    rows = [
        [
            label(m),
            f"{r['tau']:.3f}",
            f"{r['tokens_per_second']:.2f}",
            f"{r['speedup']['hf_greedy']:.2f}x",
            f"{r['speedup']['hf_prompt_lookup']:.2f}x",
            f"{r['draft_ms_per_step']:.1f}",
            f"{r['verify_ms_per_step']:.1f}",
            f"{r.get('prefill_share', 0.0):.0%}",
            ", ".join(f"{a:.2f}" for a in r["acceptance_by_depth"][:4]),
            ", ".join(f"{k} {v:.2f}" for k, v in r["source_share"].items()) or "-",
        ]
        for m, r in methods.items()
    ]
    header = [
        "method",
        "tau",
        "tokens/s",
        "vs (a)",
        "vs (b)",
        "draft ms/step",
        "verify ms/step",
        "prefill",
        "accept d1-d4",
    ]
    parts.append(markdown_table([*header, "accepted tokens by source"], rows))
    categories = sorted({c for r in methods.values() for c in r["per_category"]})
    parts.append("Per category: tau / speedup over (a), median of per-prompt ratios")
    parts.append(
        markdown_table(
            ["category", *(label(m) for m in methods)],
            [
                [c]
                + [
                    f"{r['per_category'][c]['tau']:.2f} / {r['per_category'][c]['speedup_vs_hf_greedy']:.2f}x"
                    if c in r["per_category"]
                    else "-"
                    for r in methods.values()
                ]
                for c in categories
            ],
        )
    )
    return parts


def store_sentence(store: dict) -> str:
    """How the lookup store was filled before the first prompt, as `evaluation.setup.output_store` recorded it."""
    loaded = "started empty"
    if store["loaded_from"]:
        loaded = f"started from the {store['loaded_tokens']} tokens of `{store['loaded_from']}`"
    if store["seeded_tokens"]:
        seeded = f"seeded with {store['seeded_tokens']} tokens ({store['seeded_answers']} {store['seeded_from']})"
    else:
        seeded = "not seeded" if not store["seed_budget_tokens"] else "seeded with nothing (no answer fit the budget)"
    return (
        f"Lookup store: {loaded}, {seeded} before the first prompt; seed budget {store['seed_budget_tokens']} tokens, "
        f"capacity {store['max_tokens']}."
    )


def cost_model_sentence(cost_models: dict) -> str:
    """Which cost model sized each method's trees, where it came from and what it says
    (`summary.cost_models_section`)."""
    described = []
    for method, cost in cost_models.items():
        what = "a quick first estimate" if cost["quick"] else "a full measurement"
        when = f", measured {cost['measured_at']}" if cost.get("measured_at") else ""
        nodes, ms = cost["nodes"], cost["verify_ms"]
        curve = f"{nodes[0]} node(s) {ms[0]:.3g} ms .. {nodes[-1]} nodes {ms[-1]:.3g} ms"
        note = f" ({cost['note']})" if cost.get("note") else ""
        described.append(f"{label(method)}: {what} from `{cost['source']}`{when}; {curve}{note}")
    return "Cost models (tree sizes against verification ms): " + "; ".join(described) + "."


def learned_alone_words(tree: dict) -> str:
    """The words naming the tree the learned drafter decoded with alone (`; the learned drafter alone: d2k4n4`), or
    nothing where the run did not time it (or its report predates them)."""
    learned = tree.get("learned_alone")
    return f"; the learned drafter alone: `{learned['label']}`" if learned else ""


def drafter_dtype_words(setup: dict) -> str:
    """Where the drafter computes in another dtype than the target (its drafts only), the words saying so."""
    dtype = setup.get("drafter_dtype")  # absent in reports written before it was recorded
    return f", the drafter in {dtype}" if dtype and dtype != setup["dtype"] else ""


def step_words(setup: dict) -> str:
    """The target's step (eager or compiled, and its layers) and the machine profile it ran as, where the report
    records them."""
    step, profile = setup.get("step"), setup.get("profile")  # absent in reports written before they were recorded
    words = f", the target's {step}" if step else ""
    if profile:
        words += f" as the machine profile `{profile['path']}` (sha256 {profile['sha256'][:12]})"
    return words


def markdown(report: dict) -> str:
    s, setup, speed = report["summary"], report["setup"], report["speed"]
    parts = []
    warning = mismatch_warning(report)
    if warning:
        parts.append(f"> [!CAUTION]\n> **🔴 {warning}**")  # GitHub renders a CAUTION alert in red
    parts.append("# Evaluation report")
    parts.append(
        f"Target `{setup['target']}`, {setup['drafter_kind']} drafter `{setup['drafter']}` "
        f"({setup['drafter_parameters'] / 1e6:.1f}M parameters), tree `{setup['tree']['name']}` "
        f"({setup['tree']['nodes']} nodes, depth {setup['tree']['depth']}{learned_alone_words(setup['tree'])}); "
        f"{setup['data']['source']} "
        f"({setup['data']['questions']} questions, {report['losslessness']['prompts']} prompts), "
        f"max_new_tokens {setup['max_new_tokens']}; {setup['dtype']}{drafter_dtype_words(setup)} on {setup['device']} "
        f"({setup['threads']} threads){step_words(setup)}, "
        f"backend {setup['backend']}, torch {setup['torch']}, transformers {setup['transformers']}."
    )
    if setup.get("not_run"):
        parts.append("Named but not run: " + "; ".join(f"{label(m)}: {why}" for m, why in setup["not_run"].items()))
    if setup.get("lookup_store"):
        parts.append(store_sentence(setup["lookup_store"]))
    if setup.get("cost_models"):
        parts.append(cost_model_sentence(setup["cost_models"]))
    parts.append(
        markdown_table(
            [
                "tau",
                "mean accepted draft",
                "speedup vs (a)",
                "speedup vs (b)",
                "draft ms/step",
                "verify ms/step",
                "losslessness",
                "equal to (g)",
            ],
            [
                [
                    f"{s['tau']:.3f}",
                    f"{s['mean_accepted_draft']:.3f}",
                    f"{s['speedup_vs_hf_greedy']:.2f}x",
                    f"{s['speedup_vs_hf_prompt_lookup']:.2f}x",
                    f"{s['draft_ms_per_step']:.1f}",
                    f"{s['verify_ms_per_step']:.1f}",
                    f"{s['losslessness']:.3f}",
                    share_text(s.get("stock_equality")),
                ]
            ],
        )
    )
    by_depth = report["acceptance"].get("acceptance_by_depth") or []
    if by_depth:
        parts.append(
            "Acceptance by depth (share of steps accepting at least d draft tokens): "
            + ", ".join(f"d{d}: {a:.2f}" for d, a in enumerate(by_depth, 1))
        )
    if report.get("skipped"):
        parts.append(f"Skipped prompts (too long for the target): {len(report['skipped'])}")
    parts.append("## Speed (median over prompts)")
    rows = []
    for m in speed["median_tokens_per_second"]:
        rows.append(
            [
                label(m),
                f"{speed['median_tokens_per_second'][m]:.2f}",
                "1.00x"
                if m == "hf_greedy"
                else f"{speed['speedup']['hf_greedy'][m]:.2f}x ({speed['paired_speedup']['hf_greedy'][m]:.2f}x)",
                "1.00x"
                if m == "hf_prompt_lookup"
                else f"{speed['speedup']['hf_prompt_lookup'][m]:.2f}x ({speed['paired_speedup']['hf_prompt_lookup'][m]:.2f}x)",
            ]
        )
    parts.append(markdown_table(["method", "tokens/s", "vs (a) (paired)", "vs (b) (paired)"], rows))
    parts.extend(batch_markdown(speed))
    parts.extend(methods_markdown(report))
    parts.extend(equality_markdown(report))
    parts.extend(fp32_markdown(report))
    acc = report["acceptance"]
    parts.append("## Acceptance per category")
    parts.append(
        markdown_table(
            ["category", "prompts", "tau", "mean accepted draft"],
            [
                [c, v["prompts"], f"{v['tau']:.3f}", f"{v['mean_accepted_draft']:.3f}"]
                for c, v in sorted(acc["per_category"].items())
            ]
            + [["**all**", acc["prompts"], f"**{acc['tau']:.3f}**", f"{acc['mean_accepted_draft']:.3f}"]],
        )
    )
    if report["head_accuracy"]:
        parts.append("## Head accuracy (teacher-forced on the reference answers)")
        heads = report["head_accuracy"]
        ks = list(next(iter(heads.values())))
        parts.append(markdown_table(["head", *ks], [[h, *(f"{v[k]:.3f}" for k in ks)] for h, v in heads.items()]))
    parts.append("## tau and speed against tree size")
    parts.append(
        markdown_table(
            ["tree", "nodes", "depth", "predicted tau", "tau", "tokens/s"],
            [
                [
                    r["budget"],
                    r["nodes"],
                    r["depth"],
                    f"{r['predicted_tau']:.2f}" if "predicted_tau" in r else "-",
                    f"{r['tau']:.3f}",
                    f"{r['tokens_per_second']:.2f}",
                ]
                for r in report["tree_sweep"]
            ],
        )
    )
    parts.append("## Plots")
    parts.append("\n".join(f"![{name}]({file})" for name, file in report["plots"].items()))
    parts.append("## Definitions")
    parts.append("\n".join(f"- **{k}**: {v}" for k, v in report["definitions"].items()))
    return "\n\n".join(parts) + "\n"


def batch_markdown(speed: dict) -> list[str]:
    """At a batch size over 1: tokens/s per prompt (the table above) and in total, per method."""
    batch = speed.get("in_total")
    if batch is None:
        return []
    median, in_total = speed["median_tokens_per_second"], batch["tokens_per_second"]
    rows = [[label(m), f"{median[m]:.2f}", f"{tps:.2f}"] for m, tps in in_total.items()]
    columns = ["method", "tokens/s per prompt (median)", "tokens/s in total"]
    plain = in_total.get("plain_loop")  # (c): greedy batched as our methods are, the fair baseline at a batch
    if plain:
        columns.append("in total vs (c)")
        for row, tps in zip(rows, in_total.values(), strict=True):
            row.append(f"{tps / plain:.2f}x")
    return [
        f"## Speed at batch size {batch['batch_size']} (this project's loop decodes a batch at once; the others one "
        "prompt after another)",
        markdown_table(columns, rows),
    ]


def write_report(report: dict, out_dir: Path) -> Path:
    """report.json and report.md; returns report.md's path."""
    write_report_json(report, out_dir)
    return write_text(out_dir / "report.md", markdown(report))


# ---------------------------------------------------------------------------------------------------------------------
# Console


def print_report(report: dict, out_dir: Path, console: Console | None = None) -> None:
    console = console or Console()
    warning = mismatch_warning(report)
    if warning:
        console.print(Panel(warning, style="bold red", title="NOT LOSSLESS"))
    speed = report["speed"]
    table = Table(title=f"speed, {report['losslessness']['prompts']} prompts (median tokens/s)")
    for col in ("method", "tokens/s", "vs (a)", "vs (b)"):
        table.add_column(col, justify="right")
    for m in speed["median_tokens_per_second"]:
        table.add_row(
            label(m),
            f"{speed['median_tokens_per_second'][m]:.2f}",
            "1.00x" if m == "hf_greedy" else f"{speed['speedup']['hf_greedy'][m]:.2f}x",
            "1.00x" if m == "hf_prompt_lookup" else f"{speed['speedup']['hf_prompt_lookup'][m]:.2f}x",
        )
    console.print(table)
    batch = speed.get("in_total")
    if batch is not None:
        console.print(
            f"batch size {batch['batch_size']}, tokens/s in total: "
            + ", ".join(f"{label(m)} {tps:.2f}" for m, tps in batch["tokens_per_second"].items())
        )
    s = report["summary"]
    style = "green" if s["lossless"] else "bold red"
    console.print(
        f"tau {s['tau']:.3f} (mean accepted draft {s['mean_accepted_draft']:.3f}), "
        f"speedup {s['speedup_vs_hf_greedy']:.2f}x vs (a), {s['speedup_vs_hf_prompt_lookup']:.2f}x vs (b), "
        f"[{style}]losslessness {s['losslessness']:.3f}[/{style}]"
        + ("" if s.get("stock_equality") is None else f", equal to stock greedy {s['stock_equality']:.3f}")
    )
    fp32 = report["losslessness"].get("fp32")
    if fp32 and "skipped" not in fp32:
        console.print(
            "equal to fp32 greedy: " + ", ".join(f"{label(m)} {r['equal']:.3f}" for m, r in fp32["per_method"].items())
        )
    console.print(f"reports in {out_dir}")
