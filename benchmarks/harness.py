"""What every benchmark shares: its setup (threads, the target and a drafter), its timing loop and its output (rich
tables on the console, the figures as JSON). A benchmark is a function of its options that returns a `Report`;
`command_line.py` reads its options off its signature and `show`s what it returns.

    def run(*, nodes: tuple[int, ...] = (1, 8), repeats: int = 50, out: str = "bench_x.json") -> Report:
        target, _, _ = load(DEFAULT_TARGET)
        ms = [median_ms(lambda n=n: work(target, n), repeats) for n in nodes]
        rows = [[str(n), f"{m:.2f}"] for n, m in zip(nodes, ms)]
        return Report({"nodes": list(nodes), "ms": ms}, [table("work, ms", ["nodes", "ms"], rows)], out=out)

The timing loop: `median_ms` times `repeats` calls after untimed warm-up calls and takes their median; a call inside
a longer loop is `timed`. Copies of a model compared with each other are measured in alternating rounds
(`evaluation.timing.alternating_medians`), decoding methods interleaved prompt by prompt (`evaluation.timing
.time_methods`), and the target's forward over n tree nodes is the forward room's (`forward.cost_measure`).
"""

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from medusa_like.evaluation.setup import set_threads
from medusa_like.formats import load_drafter
from medusa_like.io import write_json
from medusa_like.targets import load_target

CONSOLE_WIDTH = 200  # wide enough for every table, also when the output is not a terminal


@dataclass
class Report:
    """What a benchmark hands back: its figures, the tables and lines that show them, and where the figures go."""

    result: dict  # written as JSON to `out`
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines printed under the tables
    out: str | Path | None = None  # None: the benchmark wrote its own files


def show(report: Report) -> dict:
    """Print the tables and notes, write the figures to `report.out` (when it names a file); returns the figures."""
    console = Console(width=CONSOLE_WIDTH)
    for item in report.tables:
        console.print(item)
    for line in report.notes:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if report.out is not None:
        write_json(report.out, report.result)
        console.print(f"wrote {report.out}", markup=False, highlight=False)
    return report.result


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """A table of already formatted cells: the first column left-aligned (names), the others right-aligned."""
    out = Table(title=title)
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        out.add_row(*row)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Setup


def use_threads(threads: int | None) -> int:
    """torch's thread count set to `threads` as the evaluation sets it (None: left as it is); the count in use."""
    set_threads(threads)
    return torch.get_num_threads()


def load(target: str, dtype: torch.dtype | str | None = "float32", drafter: str | Path | None = None, device="cpu"):
    """(target, tokenizer, drafter or None): the target as `targets.load_target` loads it (fp32 on the CPU unless
    told), and the drafter at `drafter` loaded for it (`formats.load_drafter`: any format, checked against it)."""
    model, tokenizer = load_target(target, dtype=dtype, device=device)
    return model, tokenizer, None if drafter is None else load_drafter(drafter, model)


# ---------------------------------------------------------------------------------------------------------------------
# The timing loop


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """One call of `fn`: (wall milliseconds, what it returned)."""
    start = time.perf_counter()
    result = fn()
    return 1000 * (time.perf_counter() - start), result


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The median wall milliseconds of `repeats` calls of `fn`, after `warmup` untimed ones (allocator, kernels,
    thread pools)."""
    if type(repeats) is not int or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn)[0] for _ in range(repeats))
