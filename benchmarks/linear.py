"""Linear-layer benchmark: what verifying N tree nodes costs with `nn.Linear` and with this CPU's kernels.

    python -m eval.bench linear                        # default target, fp32, this machine
    python -m eval.bench linear --dtype bfloat16 --rounds 5 --out bench_linear.json
    python -m eval.bench linear --nodes 1,2,40,50,59,64

Two copies of the target, one with its own `nn.Linear` layers (and SDPA), one with the few-row layers and the
row-invariant attention the eager step decodes on (`cpu/few_row_linear.py`: the fp32 or bf16 kernel), are timed
alternately (`measure_cost_model`: one forward plus the vocabulary projection over N nodes after a 128-token prefix),
round after round, so that both see the same machine load.
"""

import copy
from typing import Annotated

import torch

from medusa_like.evaluation.timing import alternating_medians, ms_table
from medusa_like.forward import prepare_target
from medusa_like.forward.cost_measure import measure_cost_model
from medusa_like.targets import DEFAULT_TARGET

from .harness import Report, load

SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 13, 16, 24, 32)


def verify_ms(target, sizes: list[int]) -> list[float]:
    """One round: ms of a forward over each of `sizes` nodes, the layers as they are."""
    prepared = prepare_target(target, tuned_layers=False)
    return measure_cost_model(prepared, sizes, repeats=1, attempts=1).measured_ms


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
    kernels = copy.deepcopy(stock)
    prepare_target(kernels)  # the eager step's layers and attention, as decoding gets them
    targets = {"nn.Linear": stock, "this CPU's kernels": kernels}
    median = alternating_medians(lambda model: verify_ms(model, sizes), targets, rounds)
    shown = ms_table(
        f"target forward over N nodes, ms ({dtype}, {torch.get_num_threads()} threads)", "linears", sizes, median
    )
    ratios = (f"{a / b:.2f}" for a, b in zip(median["nn.Linear"], median["this CPU's kernels"], strict=True))
    shown.add_row("ratio", *ratios)
    result = {"target": target, "dtype": dtype, "nodes": sizes, "verify_ms": median}
    return Report(result, [shown], out=out)
