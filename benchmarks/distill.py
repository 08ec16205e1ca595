"""Self-distillation throughput: the data build's engines (transformers' `generate`, this project's batched loop,
vLLM's CPU build) on the same target and prompts, in answers per minute and tokens/s.

    python -m eval.bench distill                                       # transformers and our loop, 64 prompts
    python -m eval.bench distill --prompts 32 --max-new-tokens 64 --engines transformers,medusa_like,vllm

Every engine gets the same prompt ids (the default target's chat template over the first user turn of the first
`--prompts` ShareGPT conversations that `train.distill` would select), the same sampling settings and EOS ids, through
the generators `train.distill` uses (`data.generation`): transformers and our loop in batches of `--batch-size`
prompts (distill.batch_size; transformers left-pads them and runs every row until the batch's last stops, ours drops a
row when it stops), vLLM with all prompts at once (it schedules them itself; its start-up is reported apart, and it
needs `make vllm-install`). Tokens/s = new tokens (EOS included) / wall time; answers/minute = prompts / wall time.
Greedy first: each engine's outputs are compared with transformers' prompt by prompt, and where they differ the
transformers target's logit margin between its top two tokens at the first difference is reported (a near-tie is two
engines' arithmetic, not an error); then sampled at `--temperature` (throughput only).
"""

import logging
import os
from typing import Annotated, Literal

import torch

from medusa_like.data import generation
from medusa_like.data.masks import render
from medusa_like.data.sources import user_turns
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.engines.run_stamp import machine, stamp
from medusa_like.engines.vllm.driver import VllmEngine, target_directory
from medusa_like.model import MedusaLikeModel
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
    """Every prompt's answer by `generator`, in one call, at most `batch_size` prompts decoding at once; (answers,
    wall seconds)."""
    ms, outputs = timed(lambda: generator(prompts, gen, eos, seed, batch_size))
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


ENGINES = ("transformers", "medusa_like", "vllm")


def run(
    *,
    prompts: int = 64,
    max_new_tokens: int = 128,
    batch_size: Annotated[int, "transformers' prompts a batch, our loop's rows at once"] = 32,
    temperature: float = 0.3,
    engines: tuple[str, ...] = ("transformers", "medusa_like"),
    dtype: Literal["float32", "bfloat16"] = "float32",
    compile: Annotated[Literal["auto", "true", "false"], "our loop's compiled step"] = "auto",
    threads: int = os.cpu_count(),
    out: str = "bench_distill.json",
) -> Report:
    """Self-distillation throughput: transformers' generate, this project's batched loop and vLLM on the same prompts."""
    if "transformers" not in engines or not set(engines) <= set(ENGINES):
        raise ValueError(f"engines: transformers (the reference) and any of {ENGINES[1:]}, got {list(engines)}")
    logging.basicConfig(level=logging.INFO)
    use_threads(threads)
    target, tokenizer, _ = load(DEFAULT_TARGET, dtype=dtype)
    greedy = generation.GenerationConfig(temperature=0.0, max_new_tokens=max_new_tokens, max_prompt_tokens=512)
    sampled = generation.GenerationConfig(temperature=temperature, max_new_tokens=max_new_tokens, max_prompt_tokens=512)
    ids = first_turn_prompts(tokenizer, prompts, greedy)
    eos = eos_token_ids(target, tokenizer)
    load_before = os.getloadavg()
    results, outputs, startup = {}, {}, None

    def measure(engine: str, generator, per_call: int, **extra) -> None:
        for name, gen in (("greedy", greedy), ("sampled", sampled)):
            rows, seconds = generate_all(generator, ids, gen, eos, per_call)
            outputs[(engine, name)] = new_tokens(rows, eos)
            results[f"{engine} {name}"] = {"seconds": seconds, **extra}

    measure("transformers", generation.transformers_generator(target, tokenizer), batch_size)
    if "medusa_like" in engines:
        switch = {"auto": "auto", "true": True, "false": False}[compile]
        ours = MedusaLikeModel(target, tokenizer, LookupDrafter(), tuned_layers=False, compile=switch)
        warm = generation.GenerationConfig(temperature=0.0, max_new_tokens=4, max_prompt_tokens=512)
        generate_all(generation.loop_generator(ours), ids[:batch_size], warm, eos, batch_size)  # compiles, untimed
        measure("medusa_like", generation.loop_generator(ours), batch_size, step=ours.forward.describe())
    if "vllm" in engines:
        with VllmEngine(target_directory(target, tokenizer, "."), max_model_len=2048) as engine:
            startup = engine.startup_seconds
            measure("vllm", generation.vllm_generator(engine), len(ids), startup_seconds=startup)
    load_after = os.getloadavg()
    for key, rows in outputs.items():
        entry = results[f"{key[0]} {key[1]}"]
        entry["tokens"] = sum(map(len, rows))
        entry["tokens_per_second"] = entry["tokens"] / entry["seconds"]
        entry["answers_per_minute"] = 60 * len(rows) / entry["seconds"]

    reference = outputs[("transformers", "greedy")]
    differences = {}
    for engine in [e for e in engines if e != "transformers"]:
        differences[engine] = []
        for prompt, a, b in zip(ids, reference, outputs[(engine, "greedy")], strict=True):
            if a != b:
                first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                differences[engine].append({"position": first, "margin": margin_at(target, prompt, a[:first])})
    report = {
        "date": stamp(),
        "machine": machine(),
        "prompts": len(ids),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "dtype": dtype,
        "threads": threads,
        "load_average": {"before": load_before, "after": load_after},
        "results": results,
        "greedy_equal": {engine: len(ids) - len(found) for engine, found in differences.items()},
        "greedy_differences": differences,
    }
    cells = []
    for name, entry in results.items():
        base = results[f"transformers {name.split()[1]}"]
        cells.append(
            [name, str(entry["tokens"]), f"{entry['seconds']:.1f}", f"{entry['tokens_per_second']:.1f}",
             f"{entry['answers_per_minute']:.1f}", f"{entry['answers_per_minute'] / base['answers_per_minute']:.2f}x"]
        )  # fmt: skip
    shown = table(
        f"Self-distillation, {len(ids)} prompts, {max_new_tokens} new tokens, {dtype}, batch {batch_size}",
        ["engine", "tokens", "seconds", "tokens/s", "answers/min", "vs transformers"],
        cells,
    )
    notes = [
        f"{engine} greedy: {len(ids) - len(found)} of {len(ids)} equal to transformers'; differences at (position, "
        "top-2 margin): " + ", ".join(f"({d['position']}, {d['margin']:.3f})" for d in found)
        for engine, found in differences.items()
    ]
    if startup is not None:
        notes.append(f"vLLM start-up {startup:.0f} s (not counted)")
    notes.append(f"load {load_before[1]:.1f} to {load_after[1]:.1f}")
    return Report(report, [shown], notes, out=out)
