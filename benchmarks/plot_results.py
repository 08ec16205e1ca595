"""Plot tokens/s per decoding method on one or more question sets, each bar labelled with its speedup over a baseline.

    python -m eval.bench plot_results                                     # docs/figures/headline.json -> speedup.png
    python -m eval.bench plot_results --results my_figures.json --out my.png
    python -m eval.bench plot_results --report validation=runs/x/eval/report.json,MT-Bench=runs/x/bench/report.json

The figures come either from a results file (the form of docs/figures/headline.json: `sets` maps a set's name to
{method: {"tokens_per_second", "tau"} or null when not measured}, with optional `labels`, `title`, `machine`, `date`)
or from evaluation reports (`report.json` of `python -m eval.evaluate`: its median tokens/s per method and the tau of
this project's methods). A method missing from a set, or null there, is drawn as "not measured".
"""

import json
from pathlib import Path
from typing import Annotated

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from medusa_like.evaluation.methods import label  # noqa: E402  (the report's own method labels)

from .harness import Report  # noqa: E402

DEFAULT_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "figures" / "headline.json"  # in a checkout
DEFAULT_BASELINE = "hf_greedy_stock"  # transformers greedy as it ships: what a user would otherwise run


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a results JSON or an evaluation's report.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def results_from_file(path: Path) -> dict:
    """A results file as it is, after checking it has `sets` of {method: figures or null}."""
    data = read_json(path)
    sets = data.get("sets")
    if not isinstance(sets, dict) or not sets or not all(isinstance(s, dict) for s in sets.values()):
        raise ValueError(f"{path}: expected 'sets': {{set name: {{method: {{tokens_per_second, tau}}}}}}")
    for name, methods in sets.items():
        for method, figures in methods.items():
            if figures is None:  # not measured
                continue
            tps = figures.get("tokens_per_second") if isinstance(figures, dict) else None
            if not isinstance(tps, (int, float)):
                raise ValueError(f"{path}: sets[{name!r}][{method!r}] has no numeric tokens_per_second")
    return data


def results_from_reports(named_reports: list[str]) -> dict:
    """Results in the results file's form from `NAME=path/to/report.json` arguments."""
    sets, labels = {}, {}
    for item in named_reports:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--report {item!r}: expected NAME=path/to/report.json")
        report = read_json(Path(path))
        try:
            tps = report["speed"]["median_tokens_per_second"]
        except (KeyError, TypeError):
            raise ValueError(f"{path}: not an evaluation report (no speed.median_tokens_per_second)") from None
        taus = {m: row.get("tau") for m, row in report.get("methods", {}).items()}
        sets[name] = {m: {"tokens_per_second": v, "tau": taus.get(m)} for m, v in tps.items()}
        labels.update({m: label(m) for m in tps})
    return {"sets": sets, "labels": labels}


def plot(results: dict, out: Path, baseline: str) -> Path:
    """Grouped bars: one group per method, one bar per set, annotated with tau and the speedup over `baseline`."""
    sets = results["sets"]
    labels = results.get("labels", {})
    methods = list(dict.fromkeys(m for figures in sets.values() for m in figures))
    width = 0.8 / len(sets)
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, (set_name, figures) in enumerate(sets.items()):
        base = (figures.get(baseline) or {}).get("tokens_per_second")
        for j, method in enumerate(methods):
            x = j + (i - (len(sets) - 1) / 2) * width
            entry = figures.get(method)
            if entry is None:
                ax.text(x, 1, "not measured", rotation=90, ha="center", va="bottom", fontsize=8, color="gray")
                continue
            tps = entry["tokens_per_second"]
            ax.bar(x, tps, width, color=f"C{i}", label=set_name if j == 0 else None)
            note = f"{tps / base:.2f}x" if base else ""
            if entry.get("tau") not in (None, 1, 1.0):
                note += f"\ntau {entry['tau']:.2f}"
            ax.text(x, tps, note, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels([labels.get(m, m) for m in methods], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (median over prompts)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)  # room for the labels above the tallest bar
    title = results.get("title", "tokens/s per method")
    if results.get("machine"):
        title += "\n" + ", ".join(filter(None, (results["machine"], results.get("date"))))
    title += f"\nabove each bar: speedup over {labels.get(baseline, baseline)}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run(
    *,
    results: Annotated[Path | None, f"a results JSON (default: {DEFAULT_RESULTS})"] = None,
    report: Annotated[tuple[str, ...], "evaluation reports as NAME=PATH (instead of --results)"] = (),
    baseline: Annotated[str, "the method speedups are relative to"] = DEFAULT_BASELINE,
    out: Annotated[Path | None, "PNG to write (default: speedup.png next to --results)"] = None,
) -> Report:
    """Tokens/s per decoding method on one or more question sets, each bar labelled with its speedup (a PNG)."""
    if report and results:
        raise ValueError("give --results or --report, not both")
    if report:
        figures = results_from_reports(list(report))
        out = out or Path("speedup.png")
    else:
        path = Path(results or DEFAULT_RESULTS)
        figures = results_from_file(path)
        out = out or path.with_name("speedup.png")
    written = plot(figures, Path(out), baseline)
    return Report({"figure": str(written)}, notes=[str(written)])
