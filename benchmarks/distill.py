"""Self-distillation throughput: transformers' `generate` against vLLM's CPU build, on the same target and prompts.

    python -m eval.bench distill                                       # 64 ShareGPT first turns, 128 new tokens
    python -m eval.bench distill --prompts 32 --max-new-tokens 64 --out bench_distill.json

Both engines get the same prompt ids (the default target's chat template over the first user turn of the first
`--prompts` ShareGPT conversations that `train.distill` would select), the same sampling settings and EOS ids, through
the generators `train.distill` uses (`data.generation`): transformers in batches of `--batch-size` left-padded prompts
(distill.batch_size), vLLM with all prompts at once (it schedules them itself; its engine's start-up is reported apart).
Tokens/s = new tokens (EOS included) / wall time. Greedy first: the two outputs are compared prompt by prompt, and where
they differ the transformers target's logit margin between its top two tokens at the first difference is reported (a
near-tie is two engines' arithmetic, not an error); then sampled at `--temperature` (throughput only). Needs the vLLM
environment (`make vllm-install`).
"""

import logging
import os
from typing import Annotated

import torch

from medusa_like.data import generation
from medusa_like.data.masks import render
from medusa_like.data.sources import user_turns
from medusa_like.engines.run_stamp import machine, stamp
from medusa_like.engines.vllm.driver import VllmEngine, target_directory
from medusa_like.targets import DEFAULT_TARGET, eos_token_ids

from .harness import Report, load, table, timed, use_threads


def first_turn_prompts(tokenizer, count: int, gen: generation.GenerationConfig) -> list[list[int]]:
    conversations = generation.select_conversations("sharegpt", count, tokenizer, gen)
    prompts = []
    for conv in conversations:
        system, users = user_turns(conv)
        text = render(tokenizer, [*system, {"role": "user", "content": users[0]}], True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def generate_all(generator, prompts, gen, eos, batch_size: int, seed: int = 0) -> tuple[list[list[int]], float]:
    """Every prompt's answer by `generator`, `batch_size` prompts a call; (answers, wall seconds)."""

    def every_batch() -> list[list[int]]:
        outputs = []
        for start in range(0, len(prompts), batch_size):
            outputs += generator(prompts[start : start + batch_size], gen, eos, seed + start)
        return outputs

    ms, outputs = timed(every_batch)
    return outputs, ms / 1000


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


def run(
    *,
    prompts: int = 64,
    max_new_tokens: int = 128,
    batch_size: Annotated[int, "transformers' prompts per generate call"] = 32,
    temperature: float = 0.3,
    threads: int = os.cpu_count(),
    out: str = "bench_distill.json",
) -> Report:
    """Self-distillation throughput: transformers' generate against vLLM's CPU build on the same prompts."""
    logging.basicConfig(level=logging.INFO)
    use_threads(threads)
    target, tokenizer, _ = load(DEFAULT_TARGET)
    greedy = generation.GenerationConfig(temperature=0.0, max_new_tokens=max_new_tokens, max_prompt_tokens=512)
    sampled = generation.GenerationConfig(temperature=temperature, max_new_tokens=max_new_tokens, max_prompt_tokens=512)
    ids = first_turn_prompts(tokenizer, prompts, greedy)
    eos = eos_token_ids(target, tokenizer)
    hf = generation.transformers_generator(target, tokenizer)
    load_before = os.getloadavg()
    results, outputs = {}, {}
    for name, gen in (("greedy", greedy), ("sampled", sampled)):
        rows, seconds = generate_all(hf, ids, gen, eos, batch_size)
        outputs[("transformers", name)] = new_tokens(rows, eos)
        results[f"transformers {name}"] = {"seconds": seconds}
    with VllmEngine(target_directory(target, tokenizer, "."), max_model_len=2048) as engine:
        vllm = generation.vllm_generator(engine)
        startup = engine.startup_seconds
        for name, gen in (("greedy", greedy), ("sampled", sampled)):
            rows, seconds = generate_all(vllm, ids, gen, eos, len(ids))
            outputs[("vllm", name)] = new_tokens(rows, eos)
            results[f"vllm {name}"] = {"seconds": seconds, "startup_seconds": startup}
    load_after = os.getloadavg()
    for key, rows in outputs.items():
        entry = results[f"{key[0]} {key[1]}"]
        entry["tokens"] = sum(map(len, rows))
        entry["tokens_per_second"] = entry["tokens"] / entry["seconds"]

    hf_rows, vllm_rows = outputs[("transformers", "greedy")], outputs[("vllm", "greedy")]
    differences = []
    for prompt, a, b in zip(ids, hf_rows, vllm_rows, strict=True):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            differences.append({"position": first, "margin": margin_at(target, prompt, a[:first])})
    report = {
        "date": stamp(),
        "machine": machine(),
        "prompts": len(ids),
        "max_new_tokens": max_new_tokens,
        "transformers_batch_size": batch_size,
        "threads": threads,
        "load_average": {"before": load_before, "after": load_after},
        "results": results,
        "greedy_equal": len(ids) - len(differences),
        "greedy_differences": differences,
    }
    cells = []
    for name, entry in results.items():
        base = results[f"transformers {name.split()[1]}"]["tokens_per_second"]
        speed = entry["tokens_per_second"]
        cells.append([name, str(entry["tokens"]), f"{entry['seconds']:.1f}", f"{speed:.1f}", f"{speed / base:.2f}x"])
    shown = table(
        f"Self-distillation, {len(ids)} prompts, {max_new_tokens} new tokens, fp32",
        ["engine", "tokens", "seconds", "tokens/s", "vs transformers"],
        cells,
    )
    note = (
        f"greedy: {report['greedy_equal']} of {len(ids)} equal; differences at (position, top-2 margin): "
        + ", ".join(f"({d['position']}, {d['margin']:.3f})" for d in differences)
        + f"; vLLM start-up {startup:.0f} s (not counted); load {load_before[1]:.1f} to {load_after[1]:.1f}"
    )
    return Report(report, [shown], [note], out=out)
