"""Core benchmark: the target's forward time against tree size, and speculative against plain greedy tokens/s.

    python -m eval.bench core                            # the default target and the default drafter
    python -m eval.bench core --drafter runs/x/drafter   # a trained drafter (Medusa heads or EAGLE-3)
    python -m eval.bench core --out bench_core.json --prompts 4 --max-new-tokens 96

Forward time is the forward room's cost measurement (`forward.cost_measure.measure_cost_model`, the layers as they
are): the target's forward and vocabulary projection over a tree of n nodes after a committed prefix (the cost that a
bigger tree pays per step), the sizes timed in interleaved rounds, the median per size. Decoding speed is measured on
chat prompts by the evaluation's timing harness (methods interleaved, warm-up, medians), plain greedy being this
project's own loop with no tree (same cache and backend) and transformers' `generate`.
"""

from typing import Annotated

import torch

from medusa_like.evaluation.methods import hf_runner, loop_runner
from medusa_like.evaluation.timing import median_tps, time_methods
from medusa_like.forward.cost_measure import measure_cost_model
from medusa_like.model import MedusaLikeModel

from .harness import Report, table

PROMPTS = [
    "Explain how a hash map works, in a few paragraphs.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Give me three tips for writing a good cover letter.",
    "What causes the seasons on Earth?",
]


def forward_ms(model: MedusaLikeModel, nodes: list[int], prefix_len: int, repeats: int) -> list[float]:
    """Median ms of one target forward over each of `nodes` tree nodes on a `prefix_len`-token committed prefix."""
    cost = measure_cost_model(model.forward, nodes, prefix_len, repeats, attempts=1)
    return cost.measured_ms


def decode_speed(model: MedusaLikeModel, trees: list[str], num_prompts: int, max_new_tokens: int) -> list[dict]:
    """transformers' greedy `generate` and this project's loop with each tree, timed by the evaluation's harness
    (interleaved in rotated order per prompt, after a warm-up); tokens/s is the median over prompts."""
    prompts = [model.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS[:num_prompts]]
    eos = model.eos_token_ids()
    pad = model.tokenizer.pad_token_id
    runners = {"hf_generate": hf_runner(model.target, eos, pad if pad is not None else (eos[0] if eos else None))}
    runners.update({name: loop_runner(model, model.resolve_tree(name), eos) for name in trees})
    results = time_methods(runners, prompts, max_new_tokens)
    base = median_tps(results["hf_generate"])
    rows = []
    for name, runs in results.items():
        tokens = sum(len(r["tokens"]) for r in runs)
        forwards = sum(r["stats"]["target_forwards"] if r["stats"] else len(r["tokens"]) for r in runs)
        tps = median_tps(runs)
        rows.append(
            {"method": name, "tokens_per_s": tps, "tau": tokens / max(forwards, 1), "speedup_vs_hf": tps / base}
        )
    return rows


def run(
    *,
    target: str = "smollm2-135m-instruct",
    drafter: Annotated[str | None, "drafter directory; default: the package's default drafter"] = None,
    backend: str = "auto",
    nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128),
    prefix_len: int = 256,
    repeats: int = 5,
    prompts: int = 2,
    max_new_tokens: int = 64,
    trees: tuple[str, ...] = ("none", "chain", "small", "medusa"),
    out: str = "bench_core.json",
) -> Report:
    """The target's forward time against tree size, and speculative against plain greedy tokens/s."""
    model = MedusaLikeModel.from_pretrained(target, drafter=drafter, backend=backend)
    sizes = sorted(set(nodes))
    forward = [
        {"nodes": n, "ms": ms, "relative_to_1": None}
        for n, ms in zip(sizes, forward_ms(model, sizes, prefix_len, repeats), strict=True)
    ]
    for row in forward:
        row["relative_to_1"] = row["ms"] / forward[0]["ms"]
    speed = decode_speed(model, list(trees), prompts, max_new_tokens)
    tables = [
        table(
            f"tree forward on a {prefix_len}-token prefix ({model.backend}, {model.device})",
            ["nodes", "ms", "x one token"],
            [[str(r["nodes"]), f"{r['ms']:.1f}", f"{r['relative_to_1']:.2f}"] for r in forward],
        ),
        table(
            f"greedy decoding, {prompts} prompts x {max_new_tokens} tokens",
            ["method", "tokens/s", "tau", "speedup vs HF generate"],
            [[r["method"], f"{r['tokens_per_s']:.1f}", f"{r['tau']:.2f}", f"{r['speedup_vs_hf']:.2f}x"] for r in speed],
        ),
    ]
    result = {
        "target": target,
        "drafter": drafter,
        "backend": model.backend,
        "device": str(model.device),
        "torch_threads": torch.get_num_threads(),
        "tree_forward": forward,
        "decoding": speed,
    }
    return Report(result, tables, out=out)
