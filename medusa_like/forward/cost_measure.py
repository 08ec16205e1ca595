"""Measuring what a decoding step costs on this machine: the target's verification forward timed over each number
of tree nodes, into a `CostModel` (`cost_model.py`: the data, its checks and its use).

    cost = measure_cost_model(prepared)             # forwards over 1..32 nodes after a 128-token context
    cost = quick_cost_model(prepared)               # a first estimate: a few sizes, few rounds, the kernels as they are

`prepared` is a `PreparedTarget` (`prepared.py`): its step is what is timed, its layers what the kernels are set on.

A shared CPU's speed drifts over seconds, longer than one size takes to time, so the sizes are timed in interleaved
rounds (a slow spell lands on every size alike) and the per-size medians are fitted by a non-decreasing curve, so that
no leftover blip makes more nodes look cheaper (`measured_ms` keeps the medians). A measurement that is still
implausible (`implausible`: rounds that disagree, more nodes far cheaper than fewer, n nodes dearer than n single-node
forwards, or a re-check far from the fit) is repeated, at most `attempts` times, then falls back to each size's
fastest median over the attempts (a slow spell only ever adds time); the log and `note` say which. One such spell,
taken at face value, made every tree dearer than a single token and switched drafting off.

Which kernels a full measurement times and keeps for each size is `medusa_like.forward.cpu.kernel_choice`'s (`KernelChoice`);
a quick one times the layers as they are.
"""

import logging
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import torch
from tqdm.auto import tqdm

from medusa_like.decoding.cost_model import CostModel, check_sizes, non_decreasing_fit

from .cpu.kernel_choice import KernelChoice

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


def time_rounds(forwards: Forwards, choice: KernelChoice, sizes, repeats: int, timer: Timer, bar) -> tuple:
    """({(size, option): ms per round}, {prefill option: ms per round}); the first round is a warm-up."""
    samples: dict[tuple, list[float]] = {(size, option): [] for size in sizes for option in choice.options}
    prefill_samples: dict = {option: [] for option in choice.prefill_options}
    if not choice.prefill_options:
        forwards.prefill()
    for _ in range(repeats + 1):
        for option in choice.prefill_options:
            choice.use_prefill(option)
            prefill_samples[option].append(timer("prefill", forwards.prefill))
            bar.update()
        for (size, option), times in samples.items():
            choice.use(size, option)
            times.append(timer(size, lambda size=size: forwards.forward(size)))
            bar.update()
    return samples, prefill_samples


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
    pick_kernels: bool = True,
    without: tuple[str, ...] = (),
    *,
    quick: bool = False,
    attempts: int = ATTEMPTS,
    timer: Timer = wall_ms,
) -> CostModel:
    """What verifying a tree of each of `sizes` nodes costs: the target's forward and vocabulary projection over a
    chain-shaped tree after a `prefix`-token context, timed in `repeats` interleaved rounds over all sizes (after a
    warm-up round); the per-size medians, fitted non-decreasing, checked (`implausible`, then a re-check of the
    smallest and largest size) and measured again or fallen back on as the module says. With `pick_kernels`, every
    size is timed with each kernel this machine runs for the target but those named in `without`, and the fastest is
    kept and set (`cpu.kernel_choice`); else the layers run as they are. `timer(what, run)` times one forward."""
    sizes = sorted(set(sizes))
    check_sizes("sizes", sizes)
    target, step = prepared.target, prepared.step
    if type(repeats) is not int or repeats < 1 or type(attempts) is not int or attempts < 1:
        raise ValueError(f"repeats and attempts must be integers >= 1, got {repeats!r} and {attempts!r}")
    # kernels are chosen for the eager step's few-row layers; the compiled step's are Inductor's
    pick = pick_kernels and step is prepared.eager
    choice = KernelChoice(target, sizes, prefix, pick=pick, without=without)
    forwards = Forwards(step, prefix, max(sizes))
    per_attempt = (repeats + 1) * (len(sizes) * len(choice.options) + len(choice.prefill_options)) + 2
    tried, problems = [], []
    with tqdm(total=per_attempt, desc="cost model", unit="forward", leave=False, disable=None) as bar:
        for attempt in range(1, attempts + 1):
            bar.reset(total=per_attempt)
            samples, prefill_samples = time_rounds(forwards, choice, sizes, repeats, timer, bar)
            medians = {key: statistics.median(times[1:]) for key, times in samples.items()}
            prefill_medians = {key: statistics.median(times[1:]) for key, times in prefill_samples.items()}
            tried.append((medians, prefill_medians))
            picked = choice.choose(medians, prefill_medians)
            curve = [medians[(size, picked[size])] for size in sizes]
            problem = implausible(sizes, curve, [spread(samples[(s, picked[s])][1:]) for s in sizes])
            problem = problem or recheck(forwards, sizes, non_decreasing_fit(curve), timer, bar)
            if problem is None:
                break
            problems.append(problem)
            if attempt < attempts:
                log.warning(
                    "cost model measurement %d of %d implausible (%s): measuring again", attempt, attempts, problem
                )
        else:
            medians = {key: min(m[key] for m, _ in tried) for key in tried[0][0]}
            prefill_medians = {key: min(p[key] for _, p in tried) for key in tried[0][1]}
            picked = choice.choose(medians, prefill_medians)
            curve = [medians[(size, picked[size])] for size in sizes]
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
        kernels=choice.record() if step is prepared.eager else None,
        measured_ms=curve,
        threads=torch.get_num_threads(),
        quick=quick,
        note=note,
        measured_at=now(),
    )


def quick_cost_model(prepared, timer: Timer = wall_ms) -> CostModel:
    """A first estimate, bounded to a few forwards per size: QUICK_SIZES after a QUICK_PREFIX-token context,
    QUICK_REPEATS rounds, the kernels as they are (nothing chosen, no row plan measured)."""
    return measure_cost_model(
        prepared, QUICK_SIZES, QUICK_PREFIX, QUICK_REPEATS, pick_kernels=False, quick=True, attempts=QUICK_ATTEMPTS,
        timer=timer,
    )  # fmt: skip
