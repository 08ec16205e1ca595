"""What a decoding step costs on this machine: the target's verification forward against the number of tree nodes.

    cost = measure_cost_model(target)               # forwards over 1..32 nodes after a 128-token context
    cost = quick_cost_model(target)                 # a first estimate: a few sizes, few rounds, the kernels as they are
    cost.verify(12)                                 # ms, interpolated between measured sizes
    save_tree(spec, "tree.json", cost_model=cost.to_json())
    cost = CostModel.from_json(data, target, source="file:tree.json")   # checked, and refused for another setup

A budgeted tree (`drafters/merge.py`) picks each step's node budget to maximise expected tokens per second from it:
where a forward over many nodes costs little more than one over a single token, deep trees pay; where it costs
much more, shallow ones. Where the cost models of a machine come from (a tree file, the on-disk cache, a measurement
on first use) is `cost_cache.py`'s business.

A shared CPU's speed drifts over seconds, longer than one size takes to time, so the sizes are timed in interleaved
rounds (a slow spell lands on every size alike) and the per-size medians are fitted by a non-decreasing curve, so that
no leftover blip makes more nodes look cheaper (`measured_ms` keeps the medians). A measurement that is still
implausible (`implausible`: rounds that disagree, more nodes far cheaper than fewer, n nodes dearer than n single-node
forwards, or a re-check far from the fit) is repeated, at most `attempts` times, then falls back to each size's
fastest median over the attempts (a slow spell only ever adds time); the log and `note` say which. One such spell,
taken at face value, made every tree dearer than a single token and switched drafting off.

Which kernels computed the times is not this module's business: `kernels` is an opaque record of
`medusa_like.cpu.kernel_choice`, which checks it against the target, sets it where the cost model is loaded (so that
the times hold), and chooses among the kernels this machine runs during a full measurement.
"""

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import torch
from tqdm.auto import tqdm

from medusa_like.cpu.kernel_choice import (
    LEGACY_FIELDS,
    KernelChoice,
    KernelMismatchError,
    KernelRecordError,
    apply_kernels,
    check_kernels,
    upgrade_legacy,
    validate_record,
)
from medusa_like.cpu.machine import architecture, machine_identity
from medusa_like.targets import target_fingerprint

from .attention import pick_backend, tree_attention
from .generate import target_forward
from .kv_cache import TreeKVCache
from .projection import VocabProjection

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

REQUIRED = ("nodes", "verify_ms", "target_fingerprint", "dtype", "device", "machine")


class CostModelError(ValueError):
    """A cost model that cannot be used: the message names the field and value, and what to do."""


class InvalidCostModelError(CostModelError):
    """A cost model that is not one: a missing, malformed or impossible field."""


class CostModelMismatchError(CostModelError):
    """A cost model measured for another target, dtype, device, machine or other layers."""


Timer = Callable[[object, Callable[[], object]], float]


def wall_ms(what, run: Callable[[], object]) -> float:
    """Milliseconds of `run()` on the wall clock (`run` waits for the device); `what` (a node count, or "prefill")
    says what is timed, for timers that care."""
    start = time.perf_counter()
    run()
    return 1000 * (time.perf_counter() - start)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class CostModel:
    nodes: list[int]  # tree sizes measured, root included: unique, ascending, >= 1
    verify_ms: list[float]  # milliseconds of one target forward over that many nodes: the fitted, non-decreasing curve
    target_fingerprint: str
    dtype: str
    device: str  # the device type: "cpu", "cuda"
    kernels: dict | str | None = None  # what computed the layers (`cpu.kernel_choice`'s record; None: not recorded)
    machine: str = field(default_factory=machine_identity)  # `cpu.machine.machine_identity()` where it was measured
    measured_ms: list[float] | None = None  # the per-size medians before the fit
    threads: int | None = None  # torch's intra-op threads during the measurement
    quick: bool = False  # a first estimate (few sizes and rounds), replaced by a full measurement when one is made
    note: str | None = None  # what the plausibility checks said, where a measurement was repeated or fell back
    measured_at: str | None = None  # when it was measured (UTC, ISO 8601)
    source: str = "measured"  # where this copy came from: "measured", "cache:<path>" or "file:<path>"

    def __post_init__(self):
        check_sizes("nodes", self.nodes)
        check_times("verify_ms", self.verify_ms, len(self.nodes))
        if self.measured_ms is not None:
            check_times("measured_ms", self.measured_ms, len(self.nodes))
        for name in ("target_fingerprint", "dtype", "device", "machine", "source"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise InvalidCostModelError(
                    f"cost model: {name} must be a non-empty string, got {getattr(self, name)!r}"
                )
        for name in ("note", "measured_at"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidCostModelError(f"cost model: {name} must be a string or null, got {getattr(self, name)!r}")
        if self.threads is not None and (type(self.threads) is not int or self.threads < 1):
            raise InvalidCostModelError(f"cost model: threads must be an integer >= 1 or null, got {self.threads!r}")
        if not isinstance(self.quick, bool):
            raise InvalidCostModelError(f"cost model: quick must be true or false, got {self.quick!r}")
        try:
            self.kernels = validate_record(self.kernels)
        except KernelRecordError as err:
            raise InvalidCostModelError(f"cost model: {err}") from err

    def verify(self, num_nodes: int) -> float:
        """Milliseconds to verify `num_nodes` nodes: linear between measured sizes, extrapolated beyond them."""
        nodes, ms = self.nodes, self.verify_ms
        if num_nodes <= nodes[0]:
            return ms[0]
        for i in range(1, len(nodes)):
            if num_nodes <= nodes[i]:
                share = (num_nodes - nodes[i - 1]) / (nodes[i] - nodes[i - 1])
                return ms[i - 1] + share * (ms[i] - ms[i - 1])
        slope = (ms[-1] - ms[-2]) / (nodes[-1] - nodes[-2]) if len(nodes) > 1 else 0.0
        return ms[-1] + slope * (num_nodes - nodes[-1])

    def describe(self) -> str:
        """One line for logs and reports: what it is and where it came from."""
        what = "quick first estimate" if self.quick else "full measurement"
        when = f", measured {self.measured_at}" if self.measured_at else ""
        return f"cost model ({what}, {len(self.nodes)} sizes) from {self.source}{when}"

    def to_json(self) -> dict:
        data = asdict(self)
        data["verify_ms"] = [round(x, 4) for x in self.verify_ms]
        if self.measured_ms is not None:
            data["measured_ms"] = [round(x, 4) for x in self.measured_ms]
        return data

    @classmethod
    def from_json(cls, data, target, source: str = "file") -> "CostModel":
        """The cost model `to_json` wrote (or an older file's flat kernel fields), checked field by field and refused
        unless it was measured for this target, dtype, device type, machine and layers; the target's layers are set
        to the kernels it was measured with, so that its times hold. `source` says where it was read from."""
        if not isinstance(data, dict):
            raise InvalidCostModelError(f"a cost model must be a JSON object, got {type(data).__name__}: {data!r}")
        fields = dict(data)
        missing = [name for name in REQUIRED if name not in fields]
        if missing:
            raise InvalidCostModelError(f"cost model: missing fields {missing}")
        legacy = {name: fields.pop(name) for name in LEGACY_FIELDS if name in fields}
        if legacy:
            if "kernels" in fields:
                raise InvalidCostModelError(f"cost model: both kernels and the older fields {sorted(legacy)}")
            check_sizes("nodes", fields["nodes"])
            try:
                fields["kernels"] = upgrade_legacy(legacy, fields["nodes"])
            except KernelRecordError as err:
                raise InvalidCostModelError(f"cost model: {err}") from err
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidCostModelError(f"cost model: unknown fields {sorted(unknown)}")
        model = cls(**{**fields, "source": source})
        model.check_fits(target)
        model.verify_ms = non_decreasing_fit(model.verify_ms)  # files written before the fit hold raw medians
        apply_kernels(model.kernels, target)
        return model

    def mismatches(self, target) -> list[str]:
        """How this cost model's setup differs from `target` on this machine (empty: it fits)."""
        wanted = {
            "target_fingerprint": target_fingerprint(target.config),
            "dtype": str(target.dtype),
            "device": target.device.type,
        }
        found = [f"{name} {getattr(self, name)!r} (here {value!r})" for name, value in wanted.items()
                 if getattr(self, name) != value]  # fmt: skip
        here = machine_identity()
        names_no_cpu = " " not in self.machine  # as older files: compared on the architecture alone
        if self.machine != here and not (names_no_cpu and self.machine == architecture(here)):
            found.append(f"machine {self.machine!r} (here {here!r})")
        try:
            check_kernels(self.kernels, target)
        except KernelMismatchError as err:
            found.append(str(err))
        return found

    def fits(self, target) -> bool:
        return not self.mismatches(target)

    def check_fits(self, target) -> None:
        """Refuse a cost model of another target, dtype, device type, machine or layers (one that names only the
        architecture, as older files do, is compared on that)."""
        found = self.mismatches(target)
        if found:
            raise CostModelMismatchError(
                f"{self.describe()} was measured for another setup: {'; '.join(found)}. Measure it again on this "
                "machine for this target: model.measure_cost_model(), or eval.tree_search"
            )


def check_sizes(name: str, sizes) -> None:
    if not isinstance(sizes, list) or not sizes:
        raise InvalidCostModelError(f"cost model: {name} must be a non-empty list of tree sizes, got {sizes!r}")
    for i, size in enumerate(sizes):
        if type(size) is not int or size < 1:
            raise InvalidCostModelError(f"cost model: {name}[{i}] must be an integer >= 1, got {size!r}")
        if i and size <= sizes[i - 1]:
            raise InvalidCostModelError(
                f"cost model: {name} must be unique and ascending, got {sizes[i - 1]!r} then {size!r}"
            )


def check_times(name: str, times, count: int) -> None:
    if not isinstance(times, list) or len(times) != count:
        raise InvalidCostModelError(f"cost model: {name} must be a list of {count} times (one per size), got {times!r}")
    for i, ms in enumerate(times):
        if type(ms) not in (int, float) or not math.isfinite(ms) or ms <= 0:
            raise InvalidCostModelError(f"cost model: {name}[{i}] must be a finite positive number of ms, got {ms!r}")


def non_decreasing_fit(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): each run that dips is replaced by
    its mean."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_a, n_a), (mean_b, n_b) = blocks.pop(-2), blocks.pop()
            blocks.append([(mean_a * n_a + mean_b * n_b) / (n_a + n_b), n_a + n_b])
    return [mean for mean, count in blocks for _ in range(int(count))]


# ---- measuring ----


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
    """The timed work: a `prefix`-token context's prefill into a KV cache, then the target's forward and vocabulary
    projection over a chain-shaped tree of n nodes after it (the cache rewound after each)."""

    def __init__(self, target, prefix: int, max_size: int):
        self.target, self.prefix, self.device = target, prefix, target.device
        self.vocab = target.config.get_text_config().vocab_size
        self.generator = torch.Generator().manual_seed(0)
        self.context = torch.randint(0, self.vocab, (1, prefix), generator=self.generator).to(self.device)
        self.cache = TreeKVCache.for_model(target, prefix + max_size)
        self.lm_head = VocabProjection(target)

    def _wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def prefill(self) -> None:
        self.cache.rewind(0)
        positions = torch.arange(self.prefix, device=self.device)[None]
        target_forward(self.target, self.context, positions, self.cache, None)
        self.cache.commit_all(self.prefix)
        self._wait()

    def forward(self, size: int) -> None:
        tokens = torch.randint(0, self.vocab, (1, size), generator=self.generator).to(self.device)
        positions = torch.arange(self.prefix, self.prefix + size, device=self.device)[None]
        mask = torch.ones(size, size, dtype=torch.bool, device=self.device).tril()[None, None]
        hidden, _ = target_forward(self.target, tokens, positions, self.cache, mask)
        self.lm_head(hidden).argmax(-1)
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
    target,
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
    if type(repeats) is not int or repeats < 1 or type(attempts) is not int or attempts < 1:
        raise ValueError(f"repeats and attempts must be integers >= 1, got {repeats!r} and {attempts!r}")
    choice = KernelChoice(target, sizes, prefix, pick=pick_kernels, without=without)
    forwards = Forwards(target, prefix, max(sizes))
    per_attempt = (repeats + 1) * (len(sizes) * len(choice.options) + len(choice.prefill_options)) + 2
    tried, problems = [], []
    with (
        tree_attention(target, pick_backend("auto", target.device)),
        tqdm(total=per_attempt, desc="cost model", unit="forward", leave=False, disable=None) as bar,
    ):
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
        target_fingerprint(target.config),
        str(target.dtype),
        target.device.type,
        choice.record(),
        measured_ms=curve,
        threads=torch.get_num_threads(),
        quick=quick,
        note=note,
        measured_at=now(),
    )


def quick_cost_model(target, timer: Timer = wall_ms) -> CostModel:
    """A first estimate, bounded to a few forwards per size: QUICK_SIZES after a QUICK_PREFIX-token context,
    QUICK_REPEATS rounds, the kernels as they are (nothing chosen, no row plan measured)."""
    return measure_cost_model(
        target, QUICK_SIZES, QUICK_PREFIX, QUICK_REPEATS, pick_kernels=False, quick=True, attempts=QUICK_ATTEMPTS,
        timer=timer,
    )  # fmt: skip
