"""Verification benchmark: where one verification forward's time goes, over N tree nodes.

    python -m eval.bench_verify --tree runs/make_run/tree.json       # the kernels of a tree file's cost model
    python -m eval.bench_verify --nodes 1,3,6,13 --out bench_verify.json   # without --tree: a full cost model first

The forward is the cost model's (`decoding/cost_measure.py Forwards`: the target's forward and vocabulary projection
over a chain of N nodes after a 128-token context, the cache rewound after each), run on the few-row kernels a cost
model picked for each size. Each size is timed on the wall clock (median of `--repeats` forwards), then profiled with
`torch.profiler` over as many forwards, and the operators' own time is split three ways: the linear products (every
kernel `FewRowLinear` runs: `F.linear`, weight-first products, MKL's and oneDNN's packs), attention (SDPA) and the
rest (the layers' elementwise operators, the cache, the dispatch between them). A product over one or two rows
streams every weight once and is bound by memory; what more nodes add on top of it is what a tree step pays over a
single token's forward.
"""

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from medusa_like.forward.cost_measure import PREFIX, Forwards
from medusa_like.io import write_json
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import DEFAULT_TARGET

# the operators the few-row layers' kernels run (cpu/few_row_linear.py), and SDPA's
PRODUCTS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "mkl::_mkl_linear")
ATTENTION = "scaled_dot_product"


def split(events, forwards: int) -> dict[str, float]:
    """Milliseconds per forward of the profiled operators' own time: products, attention, rest and their total."""
    parts = {"products": 0.0, "attention": 0.0, "rest": 0.0}
    for event in events:
        part = "products" if event.key in PRODUCTS else "attention" if ATTENTION in event.key else "rest"
        parts[part] += event.self_cpu_time_total / 1000 / forwards
    return {**parts, "total": sum(parts.values())}


@torch.inference_mode()
def where_time_goes(prepared, nodes: list[int], repeats: int) -> list[dict]:
    """For each node count: the wall ms of one forward (median of `repeats`) and `split` of `repeats` profiled ones,
    on `prepared`'s step (`forward.PreparedTarget`)."""
    forwards = Forwards(prepared.step, PREFIX, max(nodes))
    rows = []
    if True:
        forwards.prefill()
        for n in nodes:
            for _ in range(2):  # warm-up
                forwards.forward(n)
            wall = []
            for _ in range(repeats):
                start = time.perf_counter()
                forwards.forward(n)
                wall.append(1000 * (time.perf_counter() - start))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(repeats):
                    forwards.forward(n)
            rows.append({"nodes": n, "wall_ms": statistics.median(wall), **split(prof.key_averages(), repeats)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--tree", default=None, help="a tree file from the tree search: its cost model's kernels")
    parser.add_argument("--nodes", default="1,2,3,6,13,21", help="comma-separated node counts, 1..32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench_verify.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    nodes = sorted({int(n) for n in args.nodes.split(",")})
    if nodes[0] < 1 or nodes[-1] > 32 or args.repeats < 1:
        parser.error("--nodes must lie in 1..32 and --repeats be at least 1")
    model = MedusaLikeModel.from_pretrained(args.target, drafter="lookup", dtype="float32")
    if args.tree:
        model.use_tree_settings(args.tree)
    else:
        model.measure_cost_model()
    rows = where_time_goes(model.forward, nodes, args.repeats)
    table = Table(title=f"one verification forward after {PREFIX} tokens (ms; profiled: operators' own time)")
    for column in ("nodes", "wall", "products", "attention", "rest", "profiled total"):
        table.add_column(column, justify="right")
    for r in rows:
        cells = (r["wall_ms"], r["products"], r["attention"], r["rest"], r["total"])
        table.add_row(str(r["nodes"]), *(f"{x:.1f}" for x in cells))
    Console().print(table)
    write_json(args.out, {"target": args.target, "tree": args.tree, "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
