"""Linear-layer benchmark: what verifying N tree nodes costs with `nn.Linear`, and with `FewRowLinear` without and with
its row plans.

    python -m eval.bench linear                        # default target, fp32, this machine
    python -m eval.bench linear --rounds 5 --out bench_linear.json
    python -m eval.bench linear --nodes 1,2,40,50,59,64    # past 32 nodes: short prefills, by the layers' own plans

Five copies of the target, one with its own `nn.Linear` layers, one with `cpu/few_row_linear.py`'s computing
2..64 rows weight-first, one with those layers following their row plans (`cpu/row_plans.py`), and two with the
row kernel picked per size in whole forwards (as a full cost model measurement picks it, before the rounds: F.linear,
the plans, weight-first, padded, MKL's packed sgemm or oneDNN's pack; the second without oneDNN's), are timed
alternately (`measure_cost_model`: one forward plus the vocabulary projection over N nodes after a
128-token prefix, median of repeats), round after round, so that all five see the same machine load.
"""

import copy
from typing import Annotated

import torch

from medusa_like.evaluation.timing import alternating_medians, ms_table
from medusa_like.forward import prepare_target
from medusa_like.forward.cost_measure import measure_cost_model
from medusa_like.forward.cpu.few_row_linear import KERNEL_ROWS, use_few_row_linears
from medusa_like.targets import DEFAULT_TARGET

from .harness import Report, load

SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 13, 16, 24, 32)


def picked_kernels(target, sizes: list[int], without=()) -> list[str]:
    """The row kernel a full cost model measurement picks per size ("-" past KERNEL_ROWS), set on `target`. Sizes
    past KERNEL_ROWS follow the layers' own plans, and bf16 layers have none to pick (oneDNN's pack, where it runs)."""
    pickable = [n for n in sizes if n <= KERNEL_ROWS]
    found = measure_cost_model(prepare_target(target), pickable, without=without).kernels["rows"] if pickable else None
    return [(found or {}).get(str(n), "-") for n in sizes]


def verify_ms(target, sizes: list[int]) -> list[float]:
    """One round: ms of a forward over each of `sizes` nodes, the layers as they are."""
    prepared = prepare_target(target, tuned_layers=False)
    return measure_cost_model(prepared, sizes, repeats=1, pick_kernels=False, attempts=1).measured_ms


def run(
    *,
    target: str = DEFAULT_TARGET,
    dtype: str = "float32",
    rounds: Annotated[int, "alternating rounds; the median round is reported"] = 5,
    nodes: Annotated[tuple[int, ...], "node counts, 1..64"] = SIZES,
    out: str = "bench_linear.json",
) -> Report:
    """A verification forward over N nodes: nn.Linear against the few-row layers, copies timed alternately."""
    sizes = sorted(set(nodes))
    stock, _, _ = load(target, dtype=dtype, device=None)
    few_row, planned = copy.deepcopy(stock), copy.deepcopy(stock)
    picked, picked_without = copy.deepcopy(stock), copy.deepcopy(stock)
    for model in (planned, picked, picked_without):
        use_few_row_linears(model)
    use_few_row_linears(few_row, plans=False)
    kernels, kernels_without = picked_kernels(picked, sizes), picked_kernels(picked_without, sizes, ("onednn",))
    targets = {
        "nn.Linear": stock,
        "few_row": few_row,
        "few_row planned": planned,
        "few_row picked, no oneDNN": picked_without,
        "few_row picked": picked,
    }
    median = alternating_medians(lambda model: verify_ms(model, sizes), targets, rounds)
    shown = ms_table(
        f"target forward over N nodes, ms ({dtype}, {torch.get_num_threads()} threads)", "linears", sizes, median
    )
    shown.add_row("kernel picked, no oneDNN", *kernels_without)
    shown.add_row("kernel picked", *kernels)
    ratios = (f"{a / b:.2f}" for a, b in zip(median["nn.Linear"], median["few_row picked"], strict=True))
    shown.add_row("ratio, picked", *ratios)
    result = {
        "target": target,
        "dtype": dtype,
        "nodes": sizes,
        "verify_ms": median,
        "row_kernels": kernels,
        "row_kernels_without_onednn": kernels_without,
    }
    return Report(result, [shown], out=out)
