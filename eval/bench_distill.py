"""Self-distillation throughput: transformers' `generate` against vLLM's CPU build, on the same target and prompts.

    python -m eval.bench_distill                                       # 64 ShareGPT first turns, 128 new tokens
    python -m eval.bench_distill --prompts 32 --max-new-tokens 64 --out bench_distill.json

Both engines get the same prompt ids (the default target's chat template over the first user turn of the first
`--prompts` ShareGPT conversations that `train.distill` would select), the same sampling settings and EOS ids, through
the generators `train.distill` uses (`data.generation`): transformers in batches of `--batch-size` left-padded prompts
(distill.batch_size), vLLM with all prompts at once (it schedules them itself; its engine's start-up is reported apart).
Tokens/s = new tokens (EOS included) / wall time. Greedy first: the two outputs are compared prompt by prompt, and where
they differ the transformers target's logit margin between its top two tokens at the first difference is reported (a
near-tie is two engines' arithmetic, not an error); then sampled at `--temperature` (throughput only). Needs the vLLM
environment (`make vllm-install`). Prints a table and writes JSON.
"""

import argparse
import logging
import os
import time

import torch
from rich.console import Console
from rich.table import Table

from medusa_like.data import generation
from medusa_like.data.masks import render
from medusa_like.data.sources import user_turns
from medusa_like.engines.vllm.driver import VllmEngine, target_directory
from medusa_like.engines.report import machine, stamp
from medusa_like.io import write_json
from medusa_like.targets import DEFAULT_TARGET, eos_token_ids, load_target


def first_turn_prompts(tokenizer, count: int, gen: generation.GenerationConfig) -> list[list[int]]:
    conversations = generation.select_conversations("sharegpt", count, tokenizer, gen)
    prompts = []
    for conv in conversations:
        system, users = user_turns(conv)
        text = render(tokenizer, [*system, {"role": "user", "content": users[0]}], True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def timed(generator, prompts, gen, eos, batch_size: int, seed: int = 0) -> tuple[list[list[int]], float]:
    outputs, started = [], time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        outputs += generator(prompts[start : start + batch_size], gen, eos, seed + start)
    return outputs, time.perf_counter() - started


def new_tokens(rows: list[list[int]], eos: list[int]) -> list[list[int]]:
    """Each row up to and including its first EOS (transformers pads a finished row of a batch with EOS)."""
    out = []
    for row in rows:
        content, ended = generation.until_eos(row, eos)
        out.append(row[: len(content) + ended])
    return out


@torch.no_grad()
def margin_at(target, prompt: list[int], common: list[int]) -> float:
    """The target's top-1 minus top-2 logit after prompt + common (fp32, transformers)."""
    logits = target(torch.tensor([prompt + common])).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="transformers' prompts per generate call")
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="bench_distill.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.threads)

    target, tokenizer = load_target(DEFAULT_TARGET, dtype="float32", device="cpu")
    greedy = generation.GenerationConfig(temperature=0.0, max_new_tokens=args.max_new_tokens, max_prompt_tokens=512)
    sampled = generation.GenerationConfig(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, max_prompt_tokens=512
    )
    prompts = first_turn_prompts(tokenizer, args.prompts, greedy)
    eos = eos_token_ids(target, tokenizer)
    hf = generation.transformers_generator(target, tokenizer)
    load_before = os.getloadavg()
    results, outputs = {}, {}
    for name, gen in (("greedy", greedy), ("sampled", sampled)):
        rows, seconds = timed(hf, prompts, gen, eos, args.batch_size)
        outputs[("transformers", name)] = new_tokens(rows, eos)
        results[f"transformers {name}"] = {"seconds": seconds}
    with VllmEngine(target_directory(target, tokenizer, "."), max_model_len=2048) as engine:
        vllm = generation.vllm_generator(engine)
        startup = engine.startup_seconds
        for name, gen in (("greedy", greedy), ("sampled", sampled)):
            rows, seconds = timed(vllm, prompts, gen, eos, len(prompts))
            outputs[("vllm", name)] = new_tokens(rows, eos)
            results[f"vllm {name}"] = {"seconds": seconds, "startup_seconds": startup}
    load_after = os.getloadavg()
    for key, rows in outputs.items():
        entry = results[f"{key[0]} {key[1]}"]
        entry["tokens"] = sum(map(len, rows))
        entry["tokens_per_second"] = entry["tokens"] / entry["seconds"]

    hf_rows, vllm_rows = outputs[("transformers", "greedy")], outputs[("vllm", "greedy")]
    differences = []
    for prompt, a, b in zip(prompts, hf_rows, vllm_rows, strict=True):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            differences.append({"position": first, "margin": margin_at(target, prompt, a[:first])})
    report = {
        "date": stamp(),
        "machine": machine(),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "transformers_batch_size": args.batch_size,
        "threads": args.threads,
        "load_average": {"before": load_before, "after": load_after},
        "results": results,
        "greedy_equal": len(prompts) - len(differences),
        "greedy_differences": differences,
    }
    write_json(args.out, report)

    table = Table(title=f"Self-distillation, {len(prompts)} prompts, {args.max_new_tokens} new tokens, fp32")
    for column in ("engine", "tokens", "seconds", "tokens/s", "vs transformers"):
        table.add_column(column, justify="right" if column != "engine" else "left")
    for name, entry in results.items():
        base = results[f"transformers {name.split()[1]}"]["tokens_per_second"]
        table.add_row(
            name, str(entry["tokens"]), f"{entry['seconds']:.1f}", f"{entry['tokens_per_second']:.1f}",
            f"{entry['tokens_per_second'] / base:.2f}x",
        )  # fmt: skip
    console = Console()
    console.print(table)
    console.print(
        f"greedy: {report['greedy_equal']} of {len(prompts)} equal; differences at (position, top-2 margin): "
        + ", ".join(f"({d['position']}, {d['margin']:.3f})" for d in differences)
        + f"; vLLM start-up {startup:.0f} s (not counted); load {load_before[1]:.1f} to {load_after[1]:.1f}"
    )


if __name__ == "__main__":
    main()
