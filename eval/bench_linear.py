"""Linear-layer benchmark: what verifying N tree nodes costs with `nn.Linear`, and with `FewRowLinear` without and with
its row plans.

    python -m eval.bench_linear                      # default target, fp32, this machine
    python -m eval.bench_linear --rounds 5 --out bench_linear.json
    python -m eval.bench_linear --nodes 1,2,40,50,59,64    # past 32 nodes: short prefills, by the layers' own plans

Five copies of the target, one with its own `nn.Linear` layers, one with `cpu/few_row_linear.py`'s computing
2..64 rows weight-first, one with those layers following their row plans (`cpu/row_plans.py`), and two with the
row kernel picked per size in whole forwards (as a full cost model measurement picks it, before the rounds: F.linear,
the plans, weight-first, padded, MKL's packed sgemm or oneDNN's pack; the second without oneDNN's), are timed
alternately (`measure_cost_model`: one forward plus the vocabulary projection over N nodes after a
128-token prefix, median of repeats), round after round, so that all five see the same machine load. Prints the table
and writes JSON.
"""

import argparse
import copy

import torch
from rich.console import Console

from medusa_like.evaluation.timing import alternating_medians, ms_table
from medusa_like.forward import prepare_target
from medusa_like.forward.cost_measure import measure_cost_model
from medusa_like.forward.cpu.few_row_linear import KERNEL_ROWS, use_few_row_linears
from medusa_like.io import write_json
from medusa_like.targets import DEFAULT_TARGET, load_target

SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 13, 16, 24, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median round is reported")
    parser.add_argument("--nodes", default=",".join(map(str, SIZES)), help="comma-separated node counts, 1..64")
    parser.add_argument("--out", default="bench_linear.json")
    args = parser.parse_args()
    sizes = sorted({int(n) for n in args.nodes.split(",")})

    stock, _ = load_target(args.target, dtype=args.dtype)
    few_row, planned = copy.deepcopy(stock), copy.deepcopy(stock)
    picked, picked_without = copy.deepcopy(stock), copy.deepcopy(stock)
    for target in (planned, picked, picked_without):
        use_few_row_linears(target)
    use_few_row_linears(few_row, plans=False)
    # picked per size in whole forwards (1..KERNEL_ROWS nodes), then kept; more nodes follow the layers' own plans,
    # and bf16 layers have none to pick (oneDNN's pack, where it runs)
    pickable = [n for n in sizes if n <= KERNEL_ROWS]

    def pick(target, without=()) -> list[str]:
        """The kernel picked per size ("-" past KERNEL_ROWS), set on `target`."""
        found = (
            measure_cost_model(prepare_target(target), pickable, without=without).kernels["rows"] if pickable else None
        )
        return [(found or {}).get(str(n), "-") for n in sizes]

    kernels, kernels_without = pick(picked), pick(picked_without, without=("onednn",))
    targets = {
        "nn.Linear": stock,
        "few_row": few_row,
        "few_row planned": planned,
        "few_row picked, no oneDNN": picked_without,
        "few_row picked": picked,
    }
    median = alternating_medians(
        lambda target: (
            measure_cost_model(
                prepare_target(target, tuned_layers=False), sizes, repeats=1, pick_kernels=False, attempts=1
            ).measured_ms
        ),
        targets,
        args.rounds,
    )
    title = f"target forward over N nodes, ms ({args.dtype}, {torch.get_num_threads()} threads)"
    table = ms_table(title, "linears", sizes, median)
    base = median["nn.Linear"]
    table.add_row("kernel picked, no oneDNN", *kernels_without)
    table.add_row("kernel picked", *kernels)
    table.add_row("ratio, picked", *(f"{a / b:.2f}" for a, b in zip(base, median["few_row picked"], strict=True)))
    Console(width=200).print(table)
    write_json(
        args.out,
        {
            "target": args.target,
            "dtype": args.dtype,
            "nodes": sizes,
            "verify_ms": median,
            "row_kernels": kernels,
            "row_kernels_without_onednn": kernels_without,
        },
    )


if __name__ == "__main__":
    main()
