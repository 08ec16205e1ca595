"""Rendering an evaluation report: report.json, report.md and a rich console table (its plots: `plots.py`).

The report is the dict built by `medusa_like.evaluation.summary.build_report`; nothing here measures anything. A method
of this project whose outputs differ from a reference greedy run, (a) or (g), opens report.md and the console output
with a red warning; `failure_line` is the one line the evaluation command writes to stderr then.
"""

from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from medusa_like.evaluation.methods import REFERENCE, STOCK, label
from medusa_like.io import write_json, write_text


def failure_clauses(report: dict, name=str) -> list[str]:
    """One clause per reference greedy run that some method of this project differs from (`losslessness.failures`):
    the methods (by `name`), the reference, on how many prompts, and the range of the reference's logit margins."""
    by_reference: dict[str, list[dict]] = {}
    for f in report["losslessness"]["failures"]:
        by_reference.setdefault(f["reference"], []).append(f)
    clauses = []
    for reference, found in by_reference.items():
        methods = ", ".join(name(f["method"]) for f in found)
        verb = "differs" if len(found) == 1 else "differ"
        counts = {f["differing_prompts"] for f in found}
        if len(counts) == 1:
            where = f"on {counts.pop()} of {found[0]['prompts']} prompts" + (" each" if len(found) > 1 else "")
        else:
            where = "on " + ", ".join(str(f["differing_prompts"]) for f in found) + f" of {found[0]['prompts']} prompts"
        margins = [m for f in found for m in f["margins"] if m is not None]
        spread = f"margins {min(margins):.3g} to {max(margins):.3g}" if margins else "one output ends first"
        clauses.append(f"{methods} {verb} from {name(reference)} {where} ({spread})")
    return clauses


def mismatch_warning(report: dict) -> str | None:
    """A warning when some method of this project differs from (a), greedy on the same forward, or
    from (g), transformers' greedy as it ships (where it ran)."""
    lossless = report["losslessness"]
    if report["summary"]["lossless"]:
        return None
    failed = {(f["method"], f["reference"]) for f in lossless["failures"]}
    entries = [
        (ref, d) for ref, found in lossless["differences"].items() for d in found if (d["method"], ref) in failed
    ]
    where = ", ".join(
        f"`{d['method']}` {d['question_id']}/turn {d['turn']} at token {d['first_divergence']} against `{ref}`"
        for ref, d in entries[:5]
    )
    clauses = "; ".join(failure_clauses(report, name=lambda m: f"`{m}`"))  # labels hold commas: names are clearer
    dtype = report["setup"]["dtype"].removeprefix("torch.")
    return (
        f"LOSSLESSNESS FAILED: outputs differ from transformers' greedy decoding ({clauses}; expected equal at "
        f"temperature 0, greedy in {dtype} being the reference). First: {where}"
    )


def failure_line(report: dict) -> str | None:
    """The one line the evaluation command writes to stderr when some method of this project differs from a reference
    greedy run: the methods, the references and how many prompts, by the names `eval.methods` takes."""
    if report["summary"]["lossless"]:
        return None
    return "not lossless: " + "; ".join(failure_clauses(report))


def equality_markdown(report: dict) -> list[str]:
    """Every method's share of outputs equal to (a) and to (g), and each difference with its logit margin."""
    lossless = report["losslessness"]
    equality = lossless.get("equality")
    if not equality:
        return []
    parts = ["## Equality with greedy decoding", lossless["stock"]["note"]]
    rows = [[label(m), *(share_text(shares.get(ref)) for ref in (REFERENCE, STOCK))] for m, shares in equality.items()]
    parts.append(_table(["method", "equal to (a), same forward", "equal to (g), stock nn.Linear"], rows))
    rows = [
        [label(d["method"]), label(ref), d["question_id"], d["turn"], d["first_divergence"], margin_text(d)]
        for ref, differences in lossless["differences"].items()
        for d in differences
    ]
    if rows:
        parts.append(
            "Differences: the reference's logit margin between its token and the method's at the first difference "
            "(under the reference's layers; near zero: a near-tie that rounding flipped)"
        )
        parts.append(_table(["method", "against", "question", "turn", "first difference", "margin"], rows))
    return parts


def fp32_markdown(report: dict) -> list[str]:
    """Where the run's precision is not fp32: every method against fp32 greedy of the same weights
    (`precision.fp32_margin_section`), a row per method."""
    fp32 = report["losslessness"].get("fp32")
    if not fp32:
        return []
    title = "## Margin to fp32 greedy"
    if "skipped" in fp32:
        return [title, f"Not computed: {fp32['skipped']}."]
    intro = (
        f"Every output of this {fp32['dtype']} run against {fp32['reference']}, on the same {fp32['prompts']} prompts "
        "(the margin the precision costs; losslessness above is against greedy in the run's own precision, (a)):"
    )
    medians = ("median_tokens_followed", "median_abs_margin")
    rows = [
        [
            label(m),
            share_text(r["equal"]),
            r["differing_prompts"],
            *("-" if r[k] is None else f"{r[k]:.4g}" for k in medians),
        ]
        for m, r in fp32["per_method"].items()
    ]
    header = ["method", "equal to fp32 greedy", "prompts differing", "tokens followed (median)", "fp32 margin (median)"]
    return [title, intro, _table(header, rows)]


def share_text(share: float | None) -> str:
    return "-" if share is None else f"{share:.3f}"


def margin_text(difference: dict) -> str:
    margin = difference.get("margin")
    return difference.get("note", "-") if margin is None else f"{margin:.4g}"


# ---------------------------------------------------------------------------------------------------------------------
# Files


def write_report_json(report: dict, out_dir: Path) -> Path:
    return write_json(out_dir / "report.json", report)


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


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
    parts.append(_table([*header, "accepted tokens by source"], rows))
    categories = sorted({c for r in methods.values() for c in r["per_category"]})
    parts.append("Per category: tau / speedup over (a), median of per-prompt ratios")
    parts.append(
        _table(
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
        _table(
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
    parts.append(_table(["method", "tokens/s", "vs (a) (paired)", "vs (b) (paired)"], rows))
    parts.extend(batch_markdown(speed))
    parts.extend(methods_markdown(report))
    parts.extend(equality_markdown(report))
    parts.extend(fp32_markdown(report))
    acc = report["acceptance"]
    parts.append("## Acceptance per category")
    parts.append(
        _table(
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
        parts.append(_table(["head", *ks], [[h, *(f"{v[k]:.3f}" for k in ks)] for h, v in heads.items()]))
    parts.append("## tau and speed against tree size")
    parts.append(
        _table(
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
    median = speed["median_tokens_per_second"]
    rows = [[label(m), f"{median[m]:.2f}", f"{tps:.2f}"] for m, tps in batch["tokens_per_second"].items()]
    return [
        f"## Speed at batch size {batch['batch_size']} (this project's loop decodes a batch at once; the others one "
        "prompt after another)",
        _table(["method", "tokens/s per prompt (median)", "tokens/s in total"], rows),
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
