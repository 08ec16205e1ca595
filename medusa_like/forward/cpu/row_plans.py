"""Which kernel computes a few rows of a linear layer fastest on this machine: measured once per weight shape, cached.

BLAS picks its blocking from the product's shape, and on a CPU the time of a product over n rows is far from monotonic
in n: fewer rows can cost more than a few more, and one row by `W @ x.T` can cost more than two. A plan says, for each
row count n in 1..PLANNED_ROWS, what computes n rows fastest: `F.linear` (0), or `W @ x.T` over the rows zero-padded
to m >= n rows (m). `python -m eval.bench linear` shows the effect on a whole forward.

A decoding step streams every weight of the model from memory, so a plan is timed the same way: each call reads another
copy of the weight, COLD_BYTES of copies in all (more than any CPU's last-level cache). Timed with one weight hot in
the cache, plans chose kernels that made whole forwards dearer than no plans.

    plan = row_plan(weight)          # read from the cache, or measured (seconds per shape) and cached
    plan = cached_row_plan(weight)   # read from the cache, or None: never measures
    y = few_row_product(x, weight, bias, plan)      # few_row_linear.py, whose layers carry their weight's plan

The cache is `row_plans.json` in `io.user_cache_dir()`, keyed by plan version, CPU model, torch version, thread
count, dtype and shape; an unreadable or foreign entry is measured again (a cache loses nothing by being rebuilt).
"""

import itertools
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from medusa_like.io import exclusive_lock, user_cache_dir, write_json

from .machine import cpu_name

log = logging.getLogger(__name__)

PLANNED_ROWS = 64  # row counts a plan covers: every product short of a prefill (few_row_linear.MAX_ROWS)
NEAR = 1.05  # a kernel within 5% of the fastest counts as fast: F.linear, then the fewest padded rows, win ties
COLD_BYTES = 256 * 2**20  # the weight copies a plan's timing cycles through, so that no call finds its weight cached
PLAN_VERSION = 3  # part of the cache key: raised whenever what a plan covers changes, so stale plans are not read


def _median_ms(fn, weights: Iterator[torch.Tensor], repeats: int) -> float:
    """Median ms of `fn(weight)`, each call on the next of `weights`: a warm-up, then `repeats` timed calls."""
    samples = []
    for _ in range(repeats + 1):
        weight = next(weights)
        start = time.perf_counter()
        fn(weight)
        samples.append(time.perf_counter() - start)
    return 1000 * sorted(samples[1:])[repeats // 2]


def cold_copies(weight: torch.Tensor, total_bytes: int = COLD_BYTES) -> Iterator[torch.Tensor]:
    """`weight` and as many copies as make up `total_bytes` (two to 4096 tensors), cycled: each comes back only after
    all the others were read."""
    count = min(4096, max(2, -(-total_bytes // (weight.numel() * weight.element_size()))))
    return itertools.cycle([weight] + [weight.clone() for _ in range(count - 1)])


@torch.inference_mode()
def measure_row_plan(weight: torch.Tensor, rows: int = PLANNED_ROWS, repeats: int = 3) -> tuple[int, ...]:
    """Time `F.linear` and weight-first over 1..rows rows of `weight` [out, in], each call on a cache-cold copy; for
    each n the first of F.linear, weight-first over n, n + 1, ... rows within NEAR of the fastest."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    weights = cold_copies(weight)
    linear_ms = [_median_ms(lambda w, n=n: F.linear(x[:n], w), weights, repeats) for n in range(1, rows + 1)]
    first_ms = [_median_ms(lambda w, n=n: w @ x[:n].T, weights, repeats) for n in range(1, rows + 1)]
    plan = []
    for n in range(1, rows + 1):
        options = [(linear_ms[n - 1], 0)] + [(first_ms[m - 1], m) for m in range(n, rows + 1)]
        fastest = min(ms for ms, _ in options)
        plan.append(next(choice for ms, choice in options if ms <= NEAR * fastest))
    return tuple(plan)


def valid_plan(plan) -> bool:
    """A plan covers 1..PLANNED_ROWS rows; entry n (1-based) is 0 or a padded row count in n..PLANNED_ROWS."""
    return (
        isinstance(plan, (list, tuple))
        and len(plan) == PLANNED_ROWS
        and all(type(m) is int and (m == 0 or n <= m <= PLANNED_ROWS) for n, m in enumerate(plan, 1))
    )


def plan_key(weight: torch.Tensor) -> str:
    out_features, in_features = weight.shape
    return (
        f"v{PLAN_VERSION}|{cpu_name()}|torch {torch.__version__}|{torch.get_num_threads()} threads|"
        f"{weight.device.type}|{weight.dtype}|{out_features}x{in_features}"
    )


def cache_file() -> Path:
    return user_cache_dir() / "row_plans.json"


def read_plans(path: Path) -> dict:
    """The valid entries of a plan cache file; {} if it is missing or unreadable (with a warning)."""
    if not path.exists():
        return {}
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        log.warning("ignoring the unreadable row-plan cache %s (%s): plans will be measured again", path, err)
        return {}
    return {key: tuple(plan) for key, plan in stored.items() if valid_plan(plan)}


_PLANS: dict[str, tuple[int, ...]] = {}  # this process's plans
_READ: set[Path] = set()  # the cache files `cached_row_plan` read already


def row_plan(weight: torch.Tensor) -> tuple[int, ...]:
    """The plan for `weight` [out, in] on this machine: remembered, read from the cache file, or measured and added."""
    key = plan_key(weight)
    if key not in _PLANS:
        path = cache_file()
        with exclusive_lock(path.with_name(path.name + ".lock"), waiting="another process measures row plans"):
            stored = read_plans(path)
            if key not in stored:
                start = time.perf_counter()
                stored[key] = measure_row_plan(weight)
                log.info(
                    "measured the row plan of a %s weight in %.1f s", key.rsplit("|", 1)[1], time.perf_counter() - start
                )
                write_json(path, {k: list(v) for k, v in stored.items()})
        _PLANS.update(stored)
    return _PLANS[key]


def cached_row_plan(weight: torch.Tensor) -> tuple[int, ...] | None:
    """The plan for `weight` if this process or the cache file holds one; None otherwise (nothing is measured: what
    a model's construction and its first generation use, so that neither waits for plans)."""
    key, path = plan_key(weight), cache_file()
    if key not in _PLANS and path not in _READ:
        _READ.add(path)
        _PLANS.update(read_plans(path))
    return _PLANS.get(key)
