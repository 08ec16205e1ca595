"""This machine's cost models on disk: one per target weights, dtype, device, step, linear layers, kernel builds,
threads and torch version, measured once and read by every later process.

    cost = cached(prepared)        # the one cached for this prepared target here, or None
    cost = quick(prepared)         # a quick first estimate, measured now and cached
    cost = full(prepared)          # a full measurement, cached in place of any earlier one

The cache is one JSON file per key (`cache_key`) in `cost_models/` under `io.user_cache_dir()`
(`$MEDUSA_LIKE_CACHE_DIR`), written atomically. A cached file is checked like any cost model; a corrupt or foreign
one is refused with a log line and measured again.

On first use nothing is cached yet, and a full measurement (every tree size, several rounds) takes far
longer than a first answer: a quick first estimate is measured instead, logged and shown with a progress bar, and
cached until a full one (`PreparedTarget.measure_cost_model`, the tree search) replaces it.
"""

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from medusa_like.decoding.cost_model import CostModel, InvalidCostModelError
from medusa_like.io import user_cache_dir, write_json

from .cost_measure import QUICK_REPEATS, QUICK_SIZES, measure_cost_model, quick_cost_model
from .cpu import bf16_linear, fp32_linear, tree_attention
from .cpu.few_row_linear import linear_kernel

log = logging.getLogger(__name__)

CACHE_VERSION = 4  # part of the key: a change of what a cached cost model means starts a new cache
KERNELS = (fp32_linear.KERNEL, bf16_linear.KERNEL, tree_attention.KERNEL)  # whose builds a step's timings hold for


def cache_key(prepared) -> dict:
    """What a cached cost model must have been measured under to hold for `prepared` here: its identity, the layers
    computing its products (few-row or stock: both run on one machine), and each kernel's build (a changed kernel
    source times otherwise)."""
    return {
        "version": CACHE_VERSION,
        **prepared.identity(),
        "linears": linear_kernel(prepared.target),
        "kernels": {kernel.name: kernel.build_key() for kernel in KERNELS},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def cache_path(prepared) -> Path:
    digest = hashlib.sha256(json.dumps(cache_key(prepared), sort_keys=True).encode()).hexdigest()[:16]
    return user_cache_dir() / "cost_models" / f"{digest}.json"


def cached(prepared) -> CostModel | None:
    """The cost model cached for `prepared` here, or None: none cached, or the file refused (corrupt, or written for
    another key) with a log line."""
    path = cache_path(prepared)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or set(data) != {"key", "cost_model"}:
            raise InvalidCostModelError("not a cost model cache file (a JSON object of key and cost_model)")
        if data["key"] != cache_key(prepared):
            raise InvalidCostModelError(f"written for {data['key']}, not for {cache_key(prepared)}")
        cost = CostModel.from_json(data["cost_model"], source=f"cache:{path}")
        found = prepared.mismatches(cost)
        if found:
            raise InvalidCostModelError("; ".join(found))
        return cost
    except (OSError, ValueError) as err:  # unreadable, not UTF-8 or JSON, or not a cost model for this target
        log.warning("refusing the cached cost model %s (%s): measuring it again", path, err)
        return None


def store(cost: CostModel, prepared) -> Path:
    """Cache `cost` for `prepared` on this machine (atomically: a reader finds the old file or the new one)."""
    return write_json(cache_path(prepared), {"key": cache_key(prepared), "cost_model": cost.to_json()})


def quick(prepared) -> CostModel:
    """A quick first estimate, measured now (logged, with a progress bar) and cached."""
    log.info(
        "no cost model of this target's %s step on this machine yet: measuring a quick first estimate (%d tree "
        "sizes, %d rounds) to size the draft trees; model.forward.measure_cost_model() or the tree search measures a full one",
        prepared.step.describe(),
        len(QUICK_SIZES),
        QUICK_REPEATS,
    )
    start = time.perf_counter()
    cost = quick_cost_model(prepared)
    path = store(cost, prepared)
    log.info("quick cost model measured in %.1f s, cached in %s", time.perf_counter() - start, path)
    return cost


def full(prepared, **options) -> CostModel:
    """A full measurement (`cost_measure.measure_cost_model` with `options`), cached in place of any earlier one."""
    log.info("measuring a full cost model: every tree size, several rounds")
    start = time.perf_counter()
    cost = measure_cost_model(prepared, **options)
    path = store(cost, prepared)
    log.info("full cost model measured in %.1f s, cached in %s", time.perf_counter() - start, path)
    return cost
