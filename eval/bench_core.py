"""Core benchmark: target forward time against tree size, and speculative vs plain greedy tokens/s.

    python -m eval.bench_core                           # default target and default drafter
    python -m eval.bench_core --drafter runs/x/drafter  # a trained drafter (Medusa heads or EAGLE-3)
    python -m eval.bench_core --out bench.json --prompts 4 --max-new-tokens 96

Prints two tables and writes them as JSON. Forward time is the median of timed repeats of one tree forward over a
committed prefix (the cost that a bigger tree pays per step), on trees shaped by the static presets' prior; decoding
speed is measured on chat prompts by the evaluation's timing harness (methods interleaved, warm-up, medians), plain
greedy being this project's own loop with no tree (same cache and backend) and transformers' `generate`.
"""

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from medusa_like.decoding.tree import TokenTree
from medusa_like.decoding.tree_presets import PRESET_PRIOR, greedy_tree
from medusa_like.evaluation.methods import hf_runner, loop_runner
from medusa_like.evaluation.timing import median_tps, time_methods
from medusa_like.io import write_json
from medusa_like.model import MedusaLikeModel

PROMPTS = [
    "Explain how a hash map works, in a few paragraphs.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Give me three tips for writing a good cover letter.",
    "What causes the seasons on Earth?",
]


def time_tree_forward(model: MedusaLikeModel, num_nodes: int, prefix_len: int, repeats: int) -> float:
    """Median seconds of one target forward over a `num_nodes` tree on a `prefix_len`-token committed prefix."""
    target = model.target
    paths = greedy_tree(PRESET_PRIOR, num_nodes - 1)  # shaped like the static presets' trees
    tree = TokenTree.from_paths(paths).to(model.device)
    prefix = torch.randint(0, target.config.vocab_size, (1, prefix_len), device=model.device)
    tokens = torch.randint(0, target.config.vocab_size, (1, tree.num_nodes), device=model.device)
    step = model.forward.step
    times = []
    with torch.inference_mode():
        cache = step.new_cache(prefix_len + tree.num_nodes)
        step.forward(prefix, torch.arange(prefix_len, device=model.device)[None], None, cache, last=True)
        cache.commit_all(prefix_len)
        positions = (prefix_len + tree.depth)[None]
        mask = tree.attention_mask[None, None]
        for i in range(repeats + 1):
            start = time.perf_counter()
            step.forward(tokens, positions, mask, cache)[0].argmax(-1)
            cache.rewind(prefix_len)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    table = []
    for name, runs in results.items():
        tokens = sum(len(r["tokens"]) for r in runs)
        forwards = sum(r["stats"]["target_forwards"] if r["stats"] else len(r["tokens"]) for r in runs)
        tps = median_tps(runs)
        table.append(
            {"method": name, "tokens_per_s": tps, "tau": tokens / max(forwards, 1), "speedup_vs_hf": tps / base}
        )
    return table


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default=None, help="drafter directory; default: the package's default drafter")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--nodes", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--trees", default="none,chain,small,medusa")
    parser.add_argument("--out", default="bench_core.json")
    args = parser.parse_args(argv)

    model = MedusaLikeModel.from_pretrained(args.target, drafter=args.drafter, backend=args.backend)
    console = Console()
    forward = []
    for n in [int(x) for x in args.nodes.split(",")]:
        seconds = time_tree_forward(model, n, args.prefix_len, args.repeats)
        forward.append({"nodes": n, "ms": seconds * 1e3, "relative_to_1": None})
    for row in forward:
        row["relative_to_1"] = row["ms"] / forward[0]["ms"]
    speed = decode_speed(model, args.trees.split(","), args.prompts, args.max_new_tokens)

    table = Table(title=f"tree forward on a {args.prefix_len}-token prefix ({model.backend}, {model.device})")
    for col in ("nodes", "ms", "x one token"):
        table.add_column(col, justify="right")
    for row in forward:
        table.add_row(str(row["nodes"]), f"{row['ms']:.1f}", f"{row['relative_to_1']:.2f}")
    console.print(table)
    table = Table(title=f"greedy decoding, {args.prompts} prompts x {args.max_new_tokens} tokens")
    for col in ("method", "tokens/s", "tau", "speedup vs HF generate"):
        table.add_column(col, justify="right")
    for row in speed:
        table.add_row(row["method"], f"{row['tokens_per_s']:.1f}", f"{row['tau']:.2f}", f"{row['speedup_vs_hf']:.2f}x")
    console.print(table)

    result = {
        "target": args.target,
        "drafter": args.drafter,
        "backend": model.backend,
        "device": str(model.device),
        "torch_threads": torch.get_num_threads(),
        "tree_forward": forward,
        "decoding": speed,
    }
    write_json(args.out, result)
    console.print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
