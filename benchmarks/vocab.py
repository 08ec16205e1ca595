"""Draft-vocabulary benchmark: what a reduced draft vocabulary of N tokens covers, and what its projection costs.

    python -m eval.bench vocab --data data/original/smollm2_135m/sharegpt_text
    python -m eval.bench vocab --data <data.dir> --sizes 2048,4096,8192,16384,32768 --out bench_vocab.json

The N most frequent assistant tokens are counted on the training split of a dataset (as training does) and their
coverage is measured on its validation split: a held-out token outside the N is one the drafter can never propose.
The projection time is the median of timed [nodes, h] x [h, N] products with the target's own lm_head rows, the cost
each drafting step pays; N = the full vocabulary is the Medusa heads' (and a drafter without reduced vocabulary's).
"""

from typing import Annotated

import torch

from medusa_like.data.split import split_token_counts
from medusa_like.drafters.vocab import DraftVocab

from .harness import Report, load, median_ms, table


def projection_ms(weight: torch.Tensor, nodes: int, repeats: int) -> float:
    """Median ms of one [nodes, h] x [h, N] product with `weight` [N, h]."""
    hidden = torch.randn(nodes, weight.shape[1], dtype=weight.dtype)  # [nodes, h]
    with torch.inference_mode():
        return median_ms(lambda: hidden @ weight.T, repeats)  # [nodes, N]


def run(
    *,
    data: Annotated[str, "a dataset directory (data.dir of a training run)"],
    target: str = "smollm2-135m-instruct",
    val_fraction: Annotated[float, "the dataset's data.val_fraction"] = 0.1,
    sizes: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768),
    nodes: Annotated[tuple[int, ...], "rows projected per drafting step"] = (1, 8),
    repeats: int = 50,
    out: str = "bench_vocab.json",
) -> Report:
    """What a reduced draft vocabulary of N tokens covers on held-out answers, and what its projection costs."""
    model, _, _ = load(target, dtype=None, device=None)
    lm_head = model.get_output_embeddings().weight.detach().float()  # [V, h]
    vocab_size = lm_head.shape[0]
    train, held_out = split_token_counts(data, vocab_size, val_fraction)
    results = []
    for size in [*sizes, vocab_size]:
        vocab = DraftVocab.from_counts(train, size)
        rows = lm_head[vocab.d2t + torch.arange(vocab.size)].contiguous()  # [N, h]
        result = {
            "N": vocab.size,
            "train_coverage": float(train[vocab.t2d].sum() / train.sum()),
            "held_out_coverage": float(held_out[vocab.t2d].sum() / held_out.sum()),
        }
        result |= {f"ms_{n}_nodes": projection_ms(rows, n, repeats) for n in nodes}
        results.append(result)
    shown = table(
        f"draft vocabulary: coverage of assistant tokens, projection time ({data})",
        list(results[0]),
        [[f"{v:.4f}" if isinstance(v, float) else str(v) for v in r.values()] for r in results],
    )
    return Report({"target": target, "data": data, "results": results}, [shown], out=out)
