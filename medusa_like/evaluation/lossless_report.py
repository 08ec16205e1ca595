"""The losslessness part of an evaluation report: the warning that opens it when a method of this project differs from
a reference greedy run ((a) or (g)), the one line the evaluation command writes to stderr then, and the tables of
equality with greedy decoding and of the margin to fp32 greedy. `report.py` renders the rest.
"""

from medusa_like.evaluation.methods import REFERENCE, STOCK, label


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


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
    parts.append(markdown_table(["method", "equal to (a), same forward", "equal to (g), stock nn.Linear"], rows))
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
        parts.append(markdown_table(["method", "against", "question", "turn", "first difference", "margin"], rows))
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
    return [title, intro, markdown_table(header, rows)]


def share_text(share: float | None) -> str:
    return "-" if share is None else f"{share:.3f}"


def margin_text(difference: dict) -> str:
    margin = difference.get("margin")
    return difference.get("note", "-") if margin is None else f"{margin:.4g}"
