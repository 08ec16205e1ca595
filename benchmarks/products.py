"""Products benchmark: how fast the target's decoder products stream their weights over N rows, per way of
computing them, against this machine's memory speed and fp32 peak.

    python -m eval.bench products                          # default target, its first 8 layers, fp32
    python -m eval.bench products --rows 2,4,8,16 --ways template,aten --layers 8

A verification step at a few rows is a stream of weights: each product reads its weight once for all the rows. The
products of the target's first `layers` decoder layers (each weight its own: together larger than any cache, so every
call streams them from memory) are chained into one module, in the order a forward calls them, and computed by each
way:

    eager             the target's own nn.Linear layers
    aten              compiled with the weights frozen: ATen's packed linear (oneDNN)
    template          compiled with the weights frozen, by Inductor's C++ GEMM template: what the compiled step runs
    template+concat   the same, products of one input concatenated into one (Inductor's `cpp.enable_concat_linear`)
    template+int8     the template over weight-only int8 copies (one scale per output channel, a quarter of the
                      bytes; Inductor's weight-only int8 pattern): what an int8 target precision would stream
    kernel            this project's fp32 kernel over its packs, eager: what the eager fp32 step's few-row layers run
    kernel+avx2       the same kernel's AVX2 code on any CPU: what an AVX2-only CPU runs (left out, with a note,
                      where the kernel cannot be built)

Each way's median ms at each row count, the rate its weights stream at (GB/s) and its arithmetic (GFLOP/s), beside
the machine's own: one read of a tensor the size of the target's weights, and a large square fp32 product. A single
row is not asked: the compiled step pads one node to two rows.
"""

from typing import Annotated

import torch
from torch import nn
from torch._inductor import config as inductor_config

from medusa_like.forward.cpu import fp32_linear
from medusa_like.forward.platform import AVX512_OPTIONS, CPU_OPTIONS, micro_kernels_noexcept
from medusa_like.targets import DEFAULT_TARGET

from .harness import Report, load, median_ms, table, use_threads

WAYS = {  # Inductor's options per compiled way (None: eager)
    "eager": None,
    "aten": {"freezing": True},
    "template": CPU_OPTIONS,
    "template+concat": {**CPU_OPTIONS, **AVX512_OPTIONS},  # the compiled step's options where AVX512 runs
    "template+int8": CPU_OPTIONS,
    "kernel": None,
    "kernel+avx2": None,
}
INT8_WAYS = {"template+int8"}  # computed over `Int8Linear` copies of the products
KERNEL_WAYS = {"kernel": fp32_linear.OP, "kernel+avx2": fp32_linear.OP_AVX2}  # over `KernelLinear` copies


class Int8Linear(nn.Module):
    """A weight-only int8 copy of a bias-free nn.Linear: symmetric, one scale per output channel, computed in the
    input's dtype (the form Inductor's weight-only int8 pattern matches)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int8Linear copies bias-free products only")
        weight = linear.weight.detach()  # [O, I]
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [O]
        self.register_buffer("weight", torch.round(weight / scale[:, None]).to(torch.int8))  # [O, I]
        self.register_buffer("scale", scale)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):  # [M, I] -> [M, O]
        return torch.mm(x, self.weight.to(x.dtype).t()) * self.scale


class KernelLinear(nn.Module):
    """A copy of an fp32 nn.Linear computed by the fp32 kernel's operator `op` over the weight's pack."""

    def __init__(self, linear: nn.Linear, op: str):
        super().__init__()
        self.register_buffer("packed", fp32_linear.pack(linear.weight.detach()))  # [O / 32, I, 32]
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.op = fp32_linear.operator(op)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):  # [M, I] -> [M, O]
        return self.op(x, self.packed, self.bias, self.out_features)


class Products(nn.Module):
    """The nn.Linear products of `layers`, chained as a forward calls them: a product of the hidden width adds to the
    running state [M, H], the MLP's inner products multiply (gate * up) into [M, I] for the one that reads it, and any
    other (grouped keys and values) adds its mean, so that no product is dead code to a compiler."""

    def __init__(self, layers, hidden: int):
        super().__init__()
        self.linears = nn.ModuleList(m for layer in layers for m in layer.modules() if isinstance(m, nn.Linear))
        self.hidden = hidden

    def forward(self, x):  # [M, H]
        inner = None  # [M, I]
        for linear in self.linears:
            if linear.in_features == self.hidden:
                out = linear(x)
            else:
                out, inner = linear(inner), None
            if linear.out_features == self.hidden:
                x = x + out
                x = x / (x.norm(dim=-1, keepdim=True) + 1)  # bounded, whatever the weights
            elif linear.in_features == self.hidden and linear.out_features > self.hidden:
                inner = out if inner is None else inner * out
            else:
                x = x + out.mean(dim=-1, keepdim=True)
        return x


def products_of(target, layers: int) -> Products:
    decoder = target.base_model.layers[:layers]
    return Products(decoder, target.config.get_text_config().hidden_size).eval()


def weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def kernel_copy(module: Products, op: str) -> Products:
    """`module` with every product computed by the fp32 kernel's operator `op` (`KernelLinear`)."""
    copy = Products([], module.hidden)
    copy.linears = nn.ModuleList(KernelLinear(linear, op) for linear in module.linears)
    return copy.eval()


def int8_copy(module: Products) -> Products:
    """`module` with every product replaced by its `Int8Linear` copy."""
    quantized = Products([], module.hidden)
    quantized.linears = nn.ModuleList(Int8Linear(linear) for linear in module.linears)
    return quantized.eval()


@torch.no_grad()
def way_ms(module: Products, way: str, rows: list[int], repeats: int) -> tuple[list[float], torch.Tensor]:
    """Median ms of `module` computed by `way` at each row count (compiled once, over dynamic rows), and its output
    at the first row count (to check every way computes the same products)."""
    options = WAYS[way]
    hidden = module.hidden
    inputs = {n: torch.randn(n, hidden, generator=torch.Generator().manual_seed(n)) for n in rows}
    if options is None:
        fn = module
    else:
        micro_kernels_noexcept()  # the template's kernels as the compiled step builds them
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=True, options=options)

        def fn(x):
            torch._dynamo.mark_dynamic(x, 0, min=2, max=64)
            with inductor_config.patch(options):  # `freezing` is read from the global config while tracing
                return compiled(x)

    first = fn(inputs[rows[0]])
    return [median_ms(lambda x=inputs[n]: fn(x), repeats, warmup=2) for n in rows], first


def memory_gbs(nbytes: int, repeats: int) -> float:
    """GB/s of one read of an fp32 tensor of `nbytes` (a sum: the read, nothing written back)."""
    x = torch.ones(nbytes // 4)
    return nbytes / median_ms(x.sum, repeats) / 1e6


def peak_gflops(size: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / median_ms(lambda: a @ b, repeats) / 1e6


def run(
    *,
    target: str = DEFAULT_TARGET,
    rows: Annotated[tuple[int, ...], "rows of each product, 2..64"] = (2, 4, 8, 16),
    ways: Annotated[tuple[str, ...], f"of {', '.join(WAYS)}"] = tuple(WAYS),
    layers: Annotated[int, "decoder layers whose products are streamed"] = 8,
    repeats: int = 15,
    threads: int | None = None,
    out: str = "bench_products.json",
) -> Report:
    """The decoder's products over N rows, weights streamed from memory: each way of computing them, GB/s, GFLOP/s."""
    unknown = [w for w in ways if w not in WAYS]
    if unknown or any(not 2 <= n <= 64 for n in rows):
        raise ValueError(f"ways are {list(WAYS)} (got {list(ways)}); rows 2..64 (got {list(rows)})")
    threads = use_threads(threads)
    notes = []
    if KERNEL_WAYS.keys() & set(ways) and (why := fp32_linear.cpu_unsupported() or fp32_linear.KERNEL.load()):
        ways = tuple(w for w in ways if w not in KERNEL_WAYS)
        notes.append(f"the kernel's ways are left out: {why}")
    model, _, _ = load(target)
    module = products_of(model, layers)
    copies = {way: kernel_copy(module, op) for way, op in KERNEL_WAYS.items() if way in ways}
    if INT8_WAYS & set(ways):
        int8 = int8_copy(module)
        copies |= {way: int8 for way in INT8_WAYS & set(ways)}
    nbytes, sizes = weight_bytes(module), sorted(set(rows))
    streamed = {way: weight_bytes(copies[way]) if way in INT8_WAYS else nbytes for way in ways}
    flops = 2 * sum(p.numel() for p in module.parameters())  # a row's multiply-adds
    memory, peak = memory_gbs(weight_bytes(model), repeats), peak_gflops()
    measured, outputs = {}, {}
    for way in ways:
        measured[way], outputs[way] = way_ms(copies.get(way, module), way, sizes, repeats)
    reference = outputs[ways[0]]
    differences = {w: float((outputs[w] - reference).abs().max()) for w in ways}
    header = ["way", *(f"{n} rows: ms · GB/s · GFLOP/s" for n in sizes)]
    cells = [
        [
            way,
            *(
                f"{ms:.2f} · {streamed[way] / ms / 1e6:.1f} · {n * flops / ms / 1e6:.1f}"
                for n, ms in zip(sizes, times, strict=True)
            ),
        ]
        for way, times in measured.items()
    ]
    title = f"{layers} decoder layers' products of {target} ({nbytes / 1e6:.0f} MB fp32), {threads} threads"
    notes += [
        f"this machine: {memory:.1f} GB/s reading the target's {weight_bytes(model) / 1e6:.0f} MB; {peak:.1f} GFLOP/s "
        f"on a 1024x1024 fp32 product; at N rows a way can take no less than max({nbytes / 1e6:.0f} MB / memory "
        f"speed, N x {flops / 1e9:.2f} GFLOP / peak)",
        f"largest difference from {ways[0]}'s output: "
        + ", ".join(f"{w} {d:.1e}" for w, d in differences.items() if w != ways[0])
        + (" (int8 weights round the products: another precision)" if INT8_WAYS & set(ways) else ""),
    ]
    result = {
        "target": target,
        "layers": layers,
        "threads": threads,
        "weight_bytes": nbytes,
        "streamed_bytes": streamed,
        "rows": sizes,
        "ms": measured,
        "memory_gb_per_s": memory,
        "peak_gflop_per_s": peak,
        "max_difference": differences,
    }
    return Report(result, [table(title, header, cells)], notes, out=out)
