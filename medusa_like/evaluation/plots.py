"""An evaluation report's PNG plots (matplotlib, Agg): accepted draft tokens per step, tau per category, and tau
and tokens/s against tree size. The report is the dict `summary.build_report` makes; nothing here measures anything.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

PLOTS = {
    "accepted_histogram": "accepted_histogram.png",
    "tau_per_category": "tau_per_category.png",
    "tree_sweep": "tree_sweep.png",
}


def write_plots(report: dict, out_dir: Path) -> dict[str, str]:
    """The three PNGs; returns {plot name: file name}."""
    acc = report["acceptance"]

    fig, ax = plt.subplots(figsize=(6, 4))
    hist = acc["histogram"]
    ax.bar(range(len(hist)), hist, color="tab:blue")
    ax.set_xlabel("draft tokens accepted in one step (bonus token excluded)")
    ax.set_ylabel("tree steps")
    ax.set_title(f"tau = {acc['tau']:.2f}, mean accepted draft = {acc['mean_accepted_draft']:.2f}")
    ax.set_xticks(range(len(hist)))
    _save(fig, out_dir / PLOTS["accepted_histogram"])

    fig, ax = plt.subplots(figsize=(7, 4))
    cats = sorted(acc["per_category"])
    ax.bar(cats, [acc["per_category"][c]["tau"] for c in cats], color="tab:green")
    ax.axhline(acc["tau"], color="black", linestyle="--", label=f"all: {acc['tau']:.2f}")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("tau per category")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
    _save(fig, out_dir / PLOTS["tau_per_category"])

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = sorted(report["tree_sweep"], key=lambda r: r["nodes"])
    nodes = [r["nodes"] for r in rows]
    ax.plot(nodes, [r["tau"] for r in rows], "o-", color="tab:blue", label="tau")
    ax.set_xlabel("tree nodes (root included)")
    ax.set_ylabel("tau", color="tab:blue")
    ax.set_xscale("log", base=2)
    right = ax.twinx()
    right.plot(nodes, [r["tokens_per_second"] for r in rows], "s-", color="tab:red", label="tokens/s")
    base = report["speed"]["median_tokens_per_second"]["hf_greedy"]
    right.axhline(base, color="tab:red", linestyle=":", label=f"(a) greedy {base:.1f}/s")
    right.set_ylabel("tokens/s", color="tab:red")
    right.legend(loc="lower right")
    ax.set_title("tau and tokens/s against tree size")
    _save(fig, out_dir / PLOTS["tree_sweep"])
    return dict(PLOTS)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
