"""Draft-vocabulary benchmark: what a reduced draft vocabulary of N tokens covers, and what its projection costs.

    python -m eval.bench_vocab --data data/original/smollm2_135m/sharegpt_text
    python -m eval.bench_vocab --data <data.dir> --sizes 2048,4096,8192,16384,32768 --out bench_vocab.json

The N most frequent assistant tokens are counted on the training split of a dataset (as training does) and their
coverage is measured on its validation split: a held-out token outside the N is one the drafter can never propose.
The projection time is the median of timed [nodes, h] x [h, N] products with the target's own lm_head rows, the cost
each drafting step pays; N = the full vocabulary is the Medusa heads' (and a drafter without reduced vocabulary's).
"""

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from medusa_like.data.split import split_token_counts
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.io import write_json
from medusa_like.targets import load_target


def projection_ms(weight: torch.Tensor, nodes: int, repeats: int) -> float:
    hidden = torch.randn(nodes, weight.shape[1], dtype=weight.dtype)  # [nodes, h]
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            hidden @ weight.T  # [nodes, N]
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--data", required=True, help="a dataset directory (data.dir of a training run)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="the dataset's data.val_fraction")
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--nodes", default="1,8", help="rows projected per drafting step")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="bench_vocab.json")
    args = parser.parse_args(argv)

    target, _ = load_target(args.target)
    lm_head = target.get_output_embeddings().weight.detach().float()  # [V, h]
    vocab_size = lm_head.shape[0]
    train, held_out = split_token_counts(args.data, vocab_size, args.val_fraction)
    node_counts = [int(n) for n in args.nodes.split(",")]
    results = []
    for size in [int(s) for s in args.sizes.split(",")] + [vocab_size]:
        vocab = DraftVocab.from_counts(train, size)
        rows = lm_head[vocab.d2t + torch.arange(vocab.size)].contiguous()  # [N, h]
        result = {
            "N": vocab.size,
            "train_coverage": float(train[vocab.t2d].sum() / train.sum()),
            "held_out_coverage": float(held_out[vocab.t2d].sum() / held_out.sum()),
        }
        result |= {f"ms_{n}_nodes": projection_ms(rows, n, args.repeats) for n in node_counts}
        results.append(result)

    table = Table(title=f"draft vocabulary: coverage of assistant tokens, projection time ({args.data})")
    for column in results[0]:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in r.values()))
    Console(width=120).print(table)
    write_json(args.out, {"target": args.target, "data": args.data, "results": results})
    return results


if __name__ == "__main__":
    main()
