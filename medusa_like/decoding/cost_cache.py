"""Where a target's cost model comes from: a tree file, the one its kernels run now, the on-disk cache, or a
measurement; measured once per machine, target, dtype and device, and kept on disk.

    cost = machine_cost_model(target)   # the target's active one, else the cached one, else a quick first estimate
    cost = measure_and_cache(target)    # a full measurement (kernels chosen): cached, replacing a quick one
    cost = cost_model_from_file(data, target, path)     # a tree file's: checked, its kernels set

A target's active cost model is the last one loaded for it or measured on it in this process: its kernels are the ones
the target's layers run, so every drafter on that target uses it rather than loading or measuring another (which
would set other kernels under the methods that run after it). Nothing is stored on the target itself.

The cache is one JSON file per key (`cache_key`: machine, target fingerprint, dtype, device type, layers, threads,
torch version) in `cost_models/` under `io.user_cache_dir()` (`$MEDUSA_LIKE_CACHE_DIR`), written atomically. A cached
file is checked like any cost model; a corrupt or foreign one is refused with a log line and measured again.

On first use nothing is cached yet, and a full measurement (every tree size, every kernel, several rounds) takes far
longer than a first answer: a quick first estimate (`cost_measure.quick_cost_model`) is measured instead, logged and
shown with a progress bar, and cached until a full one (`MedusaLikeModel.measure_cost_model`, the tree search)
replaces it.
"""

import hashlib
import json
import logging
import time
import weakref
from pathlib import Path

import torch

from medusa_like.cpu.kernel_choice import layers_identity
from medusa_like.cpu.machine import machine_identity
from medusa_like.io import user_cache_dir, write_json
from medusa_like.targets import target_fingerprint

from .cost_measure import QUICK_REPEATS, QUICK_SIZES, measure_cost_model, quick_cost_model
from .cost_model import CostModel, CostModelError, CostModelMismatchError, InvalidCostModelError

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # part of the key: a change of what a cached cost model means starts a new cache
_ACTIVE: "weakref.WeakKeyDictionary[torch.nn.Module, CostModel]" = weakref.WeakKeyDictionary()


def cache_key(target) -> dict:
    """What a cached cost model must have been measured under to hold for `target` here."""
    return {
        "version": CACHE_VERSION,
        "machine": machine_identity(),
        "target_fingerprint": target_fingerprint(target.config),
        "dtype": str(target.dtype),
        "device": target.device.type,
        "layers": layers_identity(target),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def cache_path(target) -> Path:
    digest = hashlib.sha256(json.dumps(cache_key(target), sort_keys=True).encode()).hexdigest()[:16]
    return user_cache_dir() / "cost_models" / f"{digest}.json"


def cached_cost_model(target) -> CostModel | None:
    """The cost model cached for `target` here (checked, its kernels set on the target), or None: none cached, or the
    file refused (corrupt, or written for another key) with a log line."""
    path = cache_path(target)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or set(data) != {"key", "cost_model"}:
            raise InvalidCostModelError("not a cost model cache file (a JSON object of key and cost_model)")
        if data["key"] != cache_key(target):
            raise CostModelMismatchError(f"written for {data['key']}, not for {cache_key(target)}")
        return CostModel.from_json(data["cost_model"], target, source=f"cache:{path}")
    except (OSError, ValueError) as err:  # unreadable, not UTF-8 or JSON, or not a cost model for this target
        log.warning("refusing the cached cost model %s (%s): measuring it again", path, err)
        return None


def store(cost: CostModel, target) -> Path:
    """Cache `cost` for `target` on this machine (atomically: a reader finds the old file or the new one)."""
    return write_json(cache_path(target), {"key": cache_key(target), "cost_model": cost.to_json()})


def active_cost_model(target) -> CostModel | None:
    """The cost model whose kernels `target` runs now, if any was loaded or measured for it in this process."""
    cost = _ACTIVE.get(target)
    return cost if cost is not None and cost.fits(target) else None


def activate(cost: CostModel, target) -> CostModel:
    _ACTIVE[target] = cost
    return cost


def machine_cost_model(target) -> CostModel:
    """The cost model `target` runs with here: its active one, else the cached one (its kernels set), else a quick
    first estimate with the kernels as they are, measured now (logged, with a progress bar) and cached."""
    cost = active_cost_model(target) or cached_cost_model(target)
    if cost is None:
        path = cache_path(target)
        log.info(
            "no cost model of this target on this machine yet: measuring a quick first estimate (%d tree sizes, %d "
            "rounds, the layers' kernels as they are) to size the draft trees; model.measure_cost_model() or the tree "
            "search measures a full one",
            len(QUICK_SIZES),
            QUICK_REPEATS,
        )
        start = time.perf_counter()
        cost = quick_cost_model(target)
        store(cost, target)
        log.info("quick cost model measured in %.1f s, cached in %s", time.perf_counter() - start, path)
    return activate(cost, target)


def measure_and_cache(target, **options) -> CostModel:
    """A full measurement for `target` (`cost_measure.measure_cost_model` with `options`: every tree size, the fastest
    kernels chosen and set), cached in place of any earlier one and made the target's active cost model."""
    log.info("measuring a full cost model: every tree size with each kernel this machine runs, several rounds")
    start = time.perf_counter()
    cost = measure_cost_model(target, **options)
    path = store(cost, target)
    log.info("full cost model measured in %.1f s, cached in %s", time.perf_counter() - start, path)
    return activate(cost, target)


def cost_model_from_file(data, target, path) -> CostModel:
    """A tree file's cost model (`data`, the file at `path`): checked, refused for another setup, its kernels set
    on `target`, and made the target's active cost model."""
    try:
        return activate(CostModel.from_json(data, target, source=f"file:{path}"), target)
    except CostModelError as err:
        raise type(err)(f"{path}: {err}") from err
