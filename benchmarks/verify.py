"""Verification benchmark: where one verification forward's time goes, over N tree nodes.

    python -m eval.bench verify --profile runs/make_run/profile.json      # the kernels of a machine profile
    python -m eval.bench verify --nodes 1,3,6,13 --out bench_verify.json  # without --profile: a full cost model first
    python -m eval.bench verify --compile --nodes 1,2,4,8,16,32           # the compiled step (forward/compiled.py)

The forward is the cost model's (`forward/cost_measure.py Forwards`: the target's forward and vocabulary projection
over a chain of N nodes after a 128-token context, the cache rewound after each), run on the layers decoding runs
(this CPU's kernels, `cpu/few_row_linear.py`). Each size is timed on the wall clock (median of `--repeats` forwards), then profiled with
`torch.profiler` over as many forwards, and the operators' own time is split three ways: the linear products (every
kernel `FewRowLinear` runs: the fp32 and bf16 kernels, `F.linear`, oneDNN's pack), attention (SDPA) and the
rest (the layers' elementwise operators, the cache, the dispatch between them). A product over one or two rows
streams every weight once and is bound by memory; what more nodes add on top of it is what a tree step pays over a
single token's forward.

With `--compile` the step is the compiled one: the products, norms, rotary and activations run inside one generated
graph whose time the profiler reports as one block ("compiled": the package's call on CPUs, Inductor's graph on GPUs),
so only the operators called out of it are told apart: on CPUs, this project's kernels (`forward/cpu/`: attention, and
bf16 products where the CPU has a bf16 dot product). `--dtype bfloat16` runs the target in bf16 (fast only where
the CPU computes bf16 natively).
"""

from typing import Annotated

import torch

from medusa_like.forward import PROFILED_ATTENTION, PROFILED_PRODUCTS, PROFILER_NAME
from medusa_like.forward.cost_measure import PREFIX, Forwards
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import DEFAULT_TARGET

from .harness import Report, median_ms, table, use_threads

COMPILED = ("CompiledFxGraph", PROFILER_NAME)  # the profiler's names for a call of compiled code (in-process, package)
MAX_NODES = 32  # the largest size a cost model measures


def split(events, forwards: int) -> dict[str, float]:
    """Milliseconds per forward of the profiled operators' own time: products, attention, compiled code (the
    generated graph's own time: fused products and elementwise work), the rest and their total."""
    parts = {"products": 0.0, "attention": 0.0, "compiled": 0.0, "rest": 0.0}
    for event in events:
        if event.key in PROFILED_PRODUCTS:
            part = "products"
        elif any(name in event.key for name in PROFILED_ATTENTION):
            part = "attention"
        else:
            part = "compiled" if any(name in event.key for name in COMPILED) else "rest"
        parts[part] += event.self_cpu_time_total / 1000 / forwards
    return {**parts, "total": sum(parts.values())}


@torch.inference_mode()
def where_time_goes(prepared, nodes: list[int], repeats: int) -> list[dict]:
    """For each node count: the wall ms of one forward (median of `repeats`) and `split` of `repeats` profiled ones,
    on `prepared`'s step (`forward.PreparedTarget`)."""
    forwards = Forwards(prepared.step, PREFIX, max(nodes))
    forwards.prefill()
    rows = []
    for n in nodes:
        wall = median_ms(lambda n=n: forwards.forward(n), repeats, warmup=2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                forwards.forward(n)
        rows.append({"nodes": n, "wall_ms": wall, **split(prof.key_averages(), repeats)})
    return rows


def run(
    *,
    target: str = DEFAULT_TARGET,
    profile: Annotated[str | None, "a machine profile from the tree search: its cost model, its compile choice"] = None,
    nodes: Annotated[tuple[int, ...], f"node counts, 1..{MAX_NODES}"] = (1, 2, 3, 6, 13, 21),
    repeats: int = 10,
    threads: int | None = None,
    compile: Annotated[bool, "the compiled step (minutes to compile on first use)"] = False,
    dtype: Annotated[str, "the target's dtype: float32 or bfloat16"] = "float32",
    out: str = "bench_verify.json",
) -> Report:
    """Where one verification forward's time goes over N nodes: products, attention, compiled code and the rest."""
    threads = use_threads(threads)
    sizes = sorted(set(nodes))
    if not sizes or sizes[0] < 1 or sizes[-1] > MAX_NODES or repeats < 1:
        raise ValueError(f"nodes must lie in 1..{MAX_NODES} and repeats be at least 1, got {nodes} and {repeats}")
    model = MedusaLikeModel.from_pretrained(
        target, drafter="lookup", dtype=dtype, compile=compile or (None if profile else False), profile=profile
    )
    rows = where_time_goes(model.forward, sizes, repeats)
    cells = [
        [str(r["nodes"]), *(f"{r[k]:.1f}" for k in ("wall_ms", "products", "attention", "compiled", "rest", "total"))]
        for r in rows
    ]
    shown = table(
        f"one verification forward after {PREFIX} tokens, {model.forward.describe()}, {dtype} (ms; profiled: "
        "operators' own time)",
        ["nodes", "wall", "products", "attention", "compiled", "rest", "profiled total"],
        cells,
    )
    data = {"target": target, "profile": profile, "threads": threads, "step": model.forward.describe(), "dtype": dtype}
    return Report({**data, "rows": rows}, [shown], out=out)
