"""Prefill benchmark: what the target's forward over an N-token prompt costs with each prefill kernel.

    python -m eval.bench_prefill                                  # default target, fp32, N = 65, 128, 300, 600
    python -m eval.bench_prefill --tokens 128,512 --rounds 5 --out bench_prefill.json
    python -m eval.bench_prefill --batch 4 --tokens 384          # training's read: [4, 384] through the public forward

A prompt's products run over more rows than any tree step (over `few_row_linear.MAX_ROWS`), by the prefill kernel the
cost model picks (`few_row_linear.PREFILL_KERNELS`: F.linear, or oneDNN's pack). A copy of the target with its own
`nn.Linear` layers and a few-row copy per prefill kernel this machine can run prefill random prompts of each length
alternately, round after round (the forward alone, into an empty KV cache: decoding projects only a prompt's last
row); the median round is reported. With `--batch B`, each round instead reads B rows of N tokens through the
target's public forward with every hidden state returned, as training reads the frozen target (`DrafterModule
.target_hidden`, the target cache's build). Prints the table and writes JSON.
"""

import argparse
import copy
import time

import torch
from rich.console import Console

from medusa_like.decoding.attention import pick_backend
from medusa_like.decoding.step import EagerStep
from medusa_like.evaluation.timing import alternating_medians, ms_table
from medusa_like.forward.cpu.few_row_linear import (
    PREFILL_KERNELS,
    set_prefill_kernel,
    sync_packs,
    usable_row_kernels,
    use_few_row_linears,
)
from medusa_like.io import write_json
from medusa_like.targets import DEFAULT_TARGET, load_target


@torch.inference_mode()
def prefill_ms(target, ids: torch.Tensor) -> float:
    """ms of the target's forward over `ids` [1, N] into an empty KV cache."""
    step = EagerStep(target, pick_backend("auto", ids.device))
    cache = step.new_cache(ids.shape[1])
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    start = time.perf_counter()
    step.forward(ids, positions, None, cache, last=True)
    return 1000 * (time.perf_counter() - start)


@torch.inference_mode()
def read_ms(target, ids: torch.Tensor) -> float:
    """ms of training's read of `ids` [B, N]: the public forward, every hidden state returned."""
    start = time.perf_counter()
    target.base_model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median round is reported")
    parser.add_argument("--tokens", default="65,128,300,600", help="comma-separated prompt lengths")
    parser.add_argument("--batch", type=int, default=None, help="time training's read of B rows instead of a prefill")
    parser.add_argument("--out", default="bench_prefill.json")
    args = parser.parse_args()
    lengths = sorted({int(n) for n in args.tokens.split(",")})

    stock, _ = load_target(args.target, dtype=args.dtype)
    targets = {"nn.Linear": stock}
    for kernel in PREFILL_KERNELS:
        few_row = copy.deepcopy(stock)
        use_few_row_linears(few_row)
        if kernel in usable_row_kernels(few_row):
            set_prefill_kernel(few_row, kernel)
            sync_packs(few_row)
            targets[f"few_row, prefill {kernel}"] = few_row
    vocab = stock.config.get_text_config().vocab_size
    rows = args.batch or 1
    prompts = [torch.randint(0, vocab, (rows, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    timed = read_ms if args.batch else prefill_ms
    for target in targets.values():  # a warm-up
        timed(target, prompts[0])
    median = alternating_medians(lambda target: [timed(target, ids) for ids in prompts], targets, args.rounds)
    what = f"training's read of {rows} x N tokens" if args.batch else "target forward over an N-token prompt"
    title = f"{what}, ms ({args.dtype}, {torch.get_num_threads()} threads)"
    table = ms_table(title, "linears", lengths, median)
    Console(width=200).print(table)
    write_json(
        args.out,
        {"target": args.target, "dtype": args.dtype, "batch": args.batch, "tokens": lengths, "prefill_ms": median},
    )


if __name__ == "__main__":
    main()
