"""The one timing harness of evaluation, tree search and the core benchmark.

A method is a runner, `run(ids [1, T], max_new_tokens) -> (new token ids, DecodeStats.as_dict() or None)`. Every runner
first runs once untimed (allocator, kernels, thread pools); then, per prompt, every runner runs once, in an order
rotated from prompt to prompt so that drift on a shared machine hits every method alike. A method's speed in the
evaluation is the median of its per-prompt tokens/s (`metrics.median`), new tokens over wall seconds of the whole call,
prefill included; the tree search ranks its few prompts' figures by their geometric mean (`geometric_mean_tps`).

    runners = {"plain": loop_runner(model, "none", eos), "spec": loop_runner(model, tree, eos)}
    results = time_methods(runners, prompts, max_new_tokens=128)      # {"plain": [per-prompt result, ...], ...}
    median_tps(results["spec"])

At `eval.batch_size` B > 1 each method is given B prompts at once (`run_batch_interleaved`): this project's loop
decodes them as one batch (a runner's own `batch` form), any other method one after another (`batched`). A prompt's
tokens/s is then its own tokens over its own seconds (its time in the batch, from the call to its last token; or its
own call), and the batch's is every prompt's tokens over the batch's wall seconds.
"""

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from rich.table import Table

from medusa_like.evaluation.metrics import median, tokens_per_second

Runner = Callable[[torch.Tensor, int], tuple[list[int], dict | None]]
# a batch of prompts -> per prompt (new token ids, DecodeStats.as_dict() or None, that prompt's own seconds)
BatchRunner = Callable[[list[torch.Tensor], int], list[tuple[list[int], dict | None, float]]]
# new tokens of the untimed first run: enough to touch the allocator, the kernels and the thread pools; a whole answer
# per method would add a full answer's time per method to every evaluation (docs/results.md, commit a580579)
WARMUP_TOKENS = 8


def rotated(names: Sequence[str], rotation: int) -> list[str]:
    """`names` starting at position `rotation` (modulo their number)."""
    names = list(names)
    shift = rotation % len(names) if names else 0
    return names[shift:] + names[:shift]


def warm_up(runners: dict[str, Runner], ids: torch.Tensor, max_new_tokens: int, batch_size: int = 1) -> None:
    """Every runner once on `ids`, untimed, for `WARMUP_TOKENS` new tokens (`max_new_tokens` if fewer). With
    `batch_size` > 1, its batch form on batches of `ids` of that size and of each smaller power of two (the sizes a
    batch passes through as its rows finish: a compiled step compiles its graph for each on first use)."""
    tokens = min(max_new_tokens, WARMUP_TOKENS)
    sizes = [batch_size] + [1 << i for i in reversed(range(batch_size.bit_length())) if 1 << i < batch_size]
    for run in runners.values():
        if batch_size == 1:
            run(ids, tokens)
            continue
        for size in sizes:
            batched(run)([ids] * size, tokens)


def batched(run: Runner) -> BatchRunner:
    """`run` given a batch: its own batch form (`run.batch`: a method that decodes a batch at once), else each prompt
    in turn, each timed alone."""
    own = getattr(run, "batch", None)
    if own is not None:
        return own

    def one_by_one(prompts: list[torch.Tensor], max_new_tokens: int):
        rows = []
        for ids in prompts:
            start = time.perf_counter()
            tokens, stats = run(ids, max_new_tokens)
            rows.append((tokens, stats, time.perf_counter() - start))
        return rows

    return one_by_one


def run_batch_interleaved(
    runners: dict[str, Runner], prompts: list[torch.Tensor], max_new_tokens: int, rotation: int
) -> list[dict]:
    """Every runner once on a batch of prompts, in rotated order (`batched`): per prompt {name: {tokens, stats,
    seconds, tps, batch}}, `seconds` and `tps` the prompt's own, `batch` the whole batch's {size, seconds, tps}."""
    results: list[dict] = [{} for _ in prompts]
    for name in rotated(runners, rotation):
        start = time.perf_counter()
        rows = batched(runners[name])(prompts, max_new_tokens)
        seconds = time.perf_counter() - start
        total = sum(len(tokens) for tokens, _, _ in rows)
        batch = {"size": len(prompts), "seconds": seconds, "tps": tokens_per_second(total, seconds)}
        for result, (tokens, stats, own) in zip(results, rows, strict=True):
            tps = tokens_per_second(len(tokens), own)
            result[name] = {"tokens": tokens, "stats": stats, "seconds": own, "tps": tps, "batch": batch}
    return results


def run_interleaved(runners: dict[str, Runner], ids: torch.Tensor, max_new_tokens: int, rotation: int) -> dict:
    """Every runner once on one prompt, in rotated order: {name: {tokens, stats, seconds, tps}}."""
    result = {}
    for name in rotated(runners, rotation):
        start = time.perf_counter()
        tokens, stats = runners[name](ids, max_new_tokens)
        seconds = time.perf_counter() - start
        result[name] = {
            "tokens": tokens,
            "stats": stats,
            "seconds": seconds,
            "tps": tokens_per_second(len(tokens), seconds),
        }
    return result


def time_methods(
    runners: dict[str, Runner],
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    progress: Callable[[], None] | None = None,
) -> dict[str, list[dict]]:
    """Warm up on the first prompt (`warm_up`), then time every runner on every prompt, interleaved; returns
    {name: [run_interleaved's result per prompt]}."""
    if not prompts:
        raise ValueError("timing needs at least one prompt")
    if not runners:
        raise ValueError("timing needs at least one method")
    warm_up(runners, prompts[0], max_new_tokens)
    results: dict[str, list[dict]] = {name: [] for name in runners}
    for i, ids in enumerate(prompts):
        for name, result in run_interleaved(runners, ids, max_new_tokens, i).items():
            results[name].append(result)
        if progress is not None:
            progress()
    return results


def median_tps(results: Sequence[dict]) -> float:
    """The median tokens/s of one method's per-prompt results."""
    return median(r["tps"] for r in results)


def geometric_mean_tps(results: Sequence[dict]) -> float:
    """The geometric mean of one method's per-prompt tokens/s. Where methods ran the same prompts, ranking by it ranks
    by the mean log speed ratio between them, prompt by prompt: every prompt counts, where a median of a few prompts is
    one prompt's figure (the tree search's choices)."""
    if not results:
        raise ValueError("geometric mean of no results")
    return math.exp(statistics.fmean(math.log(r["tps"]) for r in results))


def alternating_medians(
    measure: Callable[[object], list[float]], subjects: dict, rounds: int
) -> dict[str, list[float]]:
    """Per subject, the median over `rounds` of each value `measure(subject)` returns; the subjects are measured
    alternately, round after round, so that a slow spell of the machine lands on all of them alike (the benchmarks
    that compare copies of a model)."""
    times: dict[str, list[list[float]]] = {name: [] for name in subjects}
    for _ in range(rounds):
        for name, subject in subjects.items():
            times[name].append(measure(subject))
    return {name: [statistics.median(col) for col in zip(*rows, strict=True)] for name, rows in times.items()}


def ms_table(title: str, label: str, columns: Sequence, medians: dict[str, list[float]]) -> Table:
    """A table of milliseconds: one row per name of `medians` (first column `label`), one column per `columns`."""
    table = Table(title=title)
    table.add_column(label)
    for column in columns:
        table.add_column(str(column), justify="right")
    for name, ms in medians.items():
        table.add_row(name, *(f"{x:.0f}" for x in ms))
    return table
