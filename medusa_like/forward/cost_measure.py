"""Measuring what a decoding step costs on this machine: the target's verification forward timed over each number
of tree nodes, into a `CostModel` (`cost_model.py`: the data, its checks and its use).

    cost = measure_cost_model(prepared)             # forwards over 1..32 nodes after a 128-token context
    cost = quick_cost_model(prepared)               # a first estimate: a few sizes, few rounds

`prepared` is a `PreparedTarget` (`prepared.py`): its step is what is timed, on its layers as they run.

A shared CPU's speed drifts over seconds, longer than one size takes to time, so the sizes are timed in interleaved
rounds (a slow spell lands on every size alike) and the per-size medians are fitted by a non-decreasing curve, so that
no leftover blip makes more nodes look cheaper (`measured_ms` keeps the medians). A measurement that is still
implausible (`implausible`: rounds that disagree, more nodes far cheaper than fewer, n nodes dearer than n single-node
forwards, or a re-check far from the fit) is repeated, at most `attempts` times, then falls back to each size's
fastest median over the attempts (a slow spell only ever adds time); the log and `note` say which. One such spell,
taken at face value, made every tree dearer than a single token and switched drafting off.
"""

import logging
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
from tqdm.auto import tqdm

from medusa_like.decoding.cost_model import CostModel, check_sizes, non_decreasing_fit

from .cpu.few_row_linear import kernel_record

log = logging.getLogger(__name__)

# every size a step picks from: the cost of a forward is not monotonic in the nodes
SIZES = (*range(1, 17), 20, 24, 32)
PREFIX = 128  # the context the sizes are timed after
REPEATS = 5  # timed rounds over all sizes, after a warm-up round
ATTEMPTS = 3  # measurements before falling back (`implausible`)
# a first estimate on first use: bounded to a few forwards per size, as many as a short answer's greedy steps
QUICK_SIZES = (1, 2, 4, 16)
QUICK_PREFIX = 32
QUICK_REPEATS = 2
QUICK_ATTEMPTS = 2

MAX_SPREAD = 0.5  # the rounds of a size may spread by this share of their median (`spread`; the median over sizes)
MAX_DIP = 1.5  # more nodes may measure cheaper than fewer by at most this factor (the fit smooths smaller dips)
BATCH_SLACK = 1.5  # n nodes may cost at most this times n single-node forwards (one forward never costs more than n)
RECHECK_RATIO = 1.5  # a re-check of the smallest and largest size must land within this factor of the fit
JITTER_MS = 0.5  # differences under this are the clock's and the scheduler's, never implausible

Timer = Callable[[object, Callable[[], object]], float]


def wall_ms(what, run: Callable[[], object]) -> float:
    """Milliseconds of `run()` on the wall clock (`run` waits for the device); `what` (a node count, or "prefill")
    says what is timed, for timers that care."""
    start = time.perf_counter()
    run()
    return 1000 * (time.perf_counter() - start)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def implausible(nodes: list[int], medians: list[float], spreads: list[float]) -> str | None:
    """Why per-size medians (with their rounds' spreads, (max - min) / median) cannot be this machine's steady cost,
    or None: rounds that disagree, more nodes far cheaper than fewer, or n nodes dearer than n single-node forwards."""
    if spreads and statistics.median(spreads) > MAX_SPREAD:
        return f"noisy: the rounds of a size differ by {statistics.median(spreads):.0%} of their median"
    for i in range(len(nodes)):
        for j in range(i + 1, len(nodes)):
            if medians[j] * MAX_DIP + JITTER_MS < medians[i]:
                return f"non-monotone: {nodes[j]} nodes measured {medians[j]:.3g} ms, {nodes[i]} nodes {medians[i]:.3g}"
        if medians[i] > nodes[i] / nodes[0] * medians[0] * BATCH_SLACK + JITTER_MS:
            return (
                f"{nodes[i]} nodes measured {medians[i]:.3g} ms, more than {nodes[i] // nodes[0]} forwards over "
                f"{nodes[0]} ({medians[0]:.3g} ms each) would take"
            )
    return None


def far_off(ms: float, expected: float) -> bool:
    return abs(ms - expected) > JITTER_MS and max(ms / expected, expected / ms) > RECHECK_RATIO


class Forwards:
    """The timed work: a `prefix`-token context's prefill into a KV cache, then the step's forward (logits included)
    over a chain-shaped tree of n nodes after it (the cache rewound after each)."""

    def __init__(self, step, prefix: int, max_size: int):
        self.step, self.prefix, self.device = step, prefix, step.target.device
        self.vocab = step.target.config.get_text_config().vocab_size
        self.generator = torch.Generator().manual_seed(0)
        self.context = torch.randint(0, self.vocab, (1, prefix), generator=self.generator).to(self.device)
        self.cache = step.new_cache(prefix + max_size)

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def prefill(self) -> None:
        self.cache.rewind(0)
        positions = torch.arange(self.prefix, device=self.device)[None]
        self.step.forward(self.context, positions, None, self.cache, last=True)
        self.cache.commit_all(self.prefix)
        self._wait()

    def forward(self, size: int) -> None:
        tokens = torch.randint(0, self.vocab, (1, size), generator=self.generator).to(self.device)
        positions = torch.arange(self.prefix, self.prefix + size, device=self.device)[None]
        mask = torch.ones(size, size, dtype=torch.bool, device=self.device).tril()[None, None]
        logits, _ = self.step.forward(tokens, positions, mask, self.cache)
        logits.argmax(-1)
        self._wait()
        self.cache.rewind(self.prefix)


def time_rounds(forwards: Forwards, sizes, repeats: int, timer: Timer, bar) -> dict[int, list[float]]:
    """{size: ms per round}; the first round is a warm-up."""
    samples: dict[int, list[float]] = {size: [] for size in sizes}
    forwards.prefill()
    for _ in range(repeats + 1):
        for size, times in samples.items():
            times.append(timer(size, lambda size=size: forwards.forward(size)))
            bar.update()
    return samples


def spread(times: list[float]) -> float:
    """How far a size's rounds disagree beyond the clock's jitter, relative to their median: the interquartile range
    from four rounds on (one stray round moves a median little), else max - min."""
    low, high = (
        (min(times), max(times)) if len(times) < 4 else statistics.quantiles(times, n=4, method="inclusive")[::2]
    )
    return max(high - low - JITTER_MS, 0.0) / statistics.median(times)


def recheck(forwards: Forwards, sizes: list[int], fitted: list[float], timer: Timer, bar) -> str | None:
    """Time the smallest and the largest size once more (with the kernels kept): why they disagree with the fit, or
    None. A slow spell that covered all the rounds shows here."""
    for i in (0, -1):
        ms = timer(sizes[i], lambda size=sizes[i]: forwards.forward(size))
        bar.update()
        if far_off(ms, fitted[i]):
            return f"a re-check of {sizes[i]} nodes took {ms:.3g} ms against {fitted[i]:.3g} measured"
    return None


@torch.inference_mode()
def measure_cost_model(
    prepared,
    sizes=SIZES,
    prefix: int = PREFIX,
    repeats: int = REPEATS,
    *,
    quick: bool = False,
    attempts: int = ATTEMPTS,
    timer: Timer = wall_ms,
) -> CostModel:
    """What verifying a tree of each of `sizes` nodes costs: the target's forward and vocabulary projection over a
    chain-shaped tree after a `prefix`-token context, timed in `repeats` interleaved rounds over all sizes (after a
    warm-up round); the per-size medians, fitted non-decreasing, checked (`implausible`, then a re-check of the
    smallest and largest size) and measured again or fallen back on as the module says. `timer(what, run)` times one
    forward."""
    sizes = sorted(set(sizes))
    check_sizes("sizes", sizes)
    step = prepared.step
    if type(repeats) is not int or repeats < 1 or type(attempts) is not int or attempts < 1:
        raise ValueError(f"repeats and attempts must be integers >= 1, got {repeats!r} and {attempts!r}")
    forwards = Forwards(step, prefix, max(sizes))
    per_attempt = (repeats + 1) * len(sizes) + 2
    tried, problems = [], []
    with tqdm(total=per_attempt, desc="cost model", unit="forward", leave=False, disable=None) as bar:
        for attempt in range(1, attempts + 1):
            bar.reset(total=per_attempt)
            samples = time_rounds(forwards, sizes, repeats, timer, bar)
            curve = [statistics.median(samples[size][1:]) for size in sizes]
            tried.append(curve)
            problem = implausible(sizes, curve, [spread(samples[size][1:]) for size in sizes])
            problem = problem or recheck(forwards, sizes, non_decreasing_fit(curve), timer, bar)
            if problem is None:
                break
            problems.append(problem)
            if attempt < attempts:
                log.warning(
                    "cost model measurement %d of %d implausible (%s): measuring again", attempt, attempts, problem
                )
        else:
            curve = [min(column) for column in zip(*tried, strict=True)]
            log.warning(
                "cost model still implausible after %d measurements (%s): using each size's fastest median over them",
                attempts,
                problem,
            )
    note = None
    if problems:
        fallback = len(problems) == attempts
        kept = "each size's fastest median over the attempts" if fallback else f"measurement {len(problems) + 1}"
        note = f"implausible: {'; '.join(problems)}; kept {kept}"
    return CostModel(
        sizes,
        non_decreasing_fit(curve),
        **prepared.identity(),
        kernels=kernel_record(prepared.target) if step is prepared.eager else None,
        measured_ms=curve,
        threads=torch.get_num_threads(),
        quick=quick,
        note=note,
        measured_at=now(),
    )


def quick_cost_model(prepared, timer: Timer = wall_ms) -> CostModel:
    """A first estimate, bounded to a few forwards per size: QUICK_SIZES after a QUICK_PREFIX-token context,
    QUICK_REPEATS rounds."""
    return measure_cost_model(
        prepared, QUICK_SIZES, QUICK_PREFIX, QUICK_REPEATS, quick=True, attempts=QUICK_ATTEMPTS, timer=timer
    )
