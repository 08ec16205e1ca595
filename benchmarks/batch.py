"""Batched decoding: tokens/s per row and in total against batch size, greedy and speculative on the same step, every
row checked equal to its prompt's batch-1 greedy output.

    python -m eval.bench batch                                                 # greedy and lookup, B = 1 .. 64
    python -m eval.bench batch --batch-sizes 1,8,32 --max-new-tokens 64 --compile true
    python -m eval.bench batch --batch-sizes 1,8 --compile false --pack false    # trees padded to the widest row
    python -m eval.bench batch --batch-sizes 1,8 --prompts 32                    # 32 prompts, 8 rows at a time
    python -m eval.bench batch --batch-sizes 1,8 --dtype bfloat16                # a bf16 target
    python -m eval.bench batch --drafter runs/make_run/train/drafter --methods greedy,lookup,combined \\
        --profile runs/make_run/profile.json --out bench_batch.json

Methods, all on one prepared target (the same step, kernels and compiled code): `greedy` (this project's loop, no
drafter: `tree="none"`), `lookup` (lookup alone, its budgeted tree priced by the batch's nodes) and `combined` (the
learned drafter at `--drafter` and lookup in one tree). For each batch size B, every method decodes the first B
prompts (`prompts`: chat prompts on distinct topics) as one batch, or with `--prompts` N > B the first N prompts, B
rows at a time, each finished row's place taken by the next prompt (continuous batching), timed by the evaluation's
harness
(`evaluation.timing.run_batch_interleaved`: methods in rotated order per round, after a warm-up at B and each smaller
power of two, the sizes a batch passes through as its rows finish, so that a compiled step's buckets are compiled
before timing). Tokens/s in total: every row's new tokens over the batch's wall seconds (median over rounds); per
row: the median over rows of each row's tokens over its own seconds (prefill included). The reference, each prompt's
greedy output decoded alone (batch 1), is computed once; a row that differs is counted and named in the notes. Nothing
is remembered between calls (the output store stays as loaded), so every batch size drafts from the same store.
"""

import statistics
from pathlib import Path
from typing import Annotated, Literal

import torch

from medusa_like.evaluation.methods import loop_runner
from medusa_like.evaluation.timing import run_batch_interleaved, warm_up
from medusa_like.formats import resolve_drafter
from medusa_like.model import MedusaLikeModel

from .harness import Report, table, use_threads

TOPICS = (
    "how a hash map works", "why the sky is blue", "how vaccines train the immune system", "what a compiler does",
    "how photosynthesis stores energy", "the causes of the seasons", "how a bicycle stays upright",
    "what inflation is", "how TCP recovers lost packets", "why bread rises", "how a refrigerator cools",
    "what a neural network learns", "how tides form", "the rules of chess openings", "how credit scores work",
    "what makes a good cover letter",
)  # fmt: skip
ASKS = ("Explain {} in a few paragraphs.", "Give me three short facts about {}.", "Teach a child {}.",
        "Write a short poem about {}.")  # fmt: skip
METHODS = ("greedy", "lookup", "combined")


def prompts(model: MedusaLikeModel, count: int) -> list[torch.Tensor]:
    """`count` distinct chat prompts (topics x ways of asking, in that order) as token ids [1, T]."""
    texts = [ask.format(topic) for ask in ASKS for topic in TOPICS]
    if count > len(texts):
        raise ValueError(f"{count} prompts asked for: this benchmark has {len(texts)} distinct prompts")
    return [model.chat_ids([{"role": "user", "content": text}]) for text in texts[:count]]


def batch_speed(
    models: dict, batch_sizes: list[int], max_new_tokens: int, rounds: int = 1, count: int | None = None
) -> tuple[list, list]:
    """`models`: {method: (MedusaLikeModel, tree)}, "greedy" among them -> (one row per method and batch size:
    tokens/s in total and per row, tau, rows equal to batch-1 greedy; notes naming each row that was not). Each batch
    size B decodes max(B, `count`) prompts, B rows at a time."""
    greedy, _ = models["greedy"]
    eos = greedy.eos_token_ids()
    ids = prompts(greedy, max(max(batch_sizes), count or 0))
    reference = [
        greedy.generate(p, max_new_tokens, tree="none", eos_token_id=eos, remember=False).new_tokens.tolist()
        for p in ids
    ]
    rows, notes = [], []
    for size in batch_sizes:
        runners = {name: loop_runner(model, tree, eos, size) for name, (model, tree) in models.items()}
        asked = ids[: max(size, count or 0)]
        warm_up(runners, ids[0], max_new_tokens, size)
        timed = [run_batch_interleaved(runners, asked, max_new_tokens, rotation) for rotation in range(rounds)]
        for name in runners:
            last = [prompt[name] for prompt in timed[-1]]
            differing = [i for i, result in enumerate(last) if result["tokens"] != reference[i]]
            notes += [f"{name} at batch {size}: prompt {i} differs from its batch-1 greedy output" for i in differing]
            tokens = sum(len(r["tokens"]) for r in last)
            forwards = sum(r["stats"]["target_forwards"] for r in last)
            rows.append(
                {
                    "method": name,
                    "batch_size": size,
                    "prompts": len(asked),
                    "tokens_per_second": statistics.median(rnd[0][name]["batch"]["tps"] for rnd in timed),
                    "tokens_per_second_per_row": statistics.median(r["tps"] for r in last),
                    "tau": tokens / max(forwards, 1),
                    "equal_rows": len(asked) - len(differing),
                }
            )
    base = {r["batch_size"]: r["tokens_per_second"] for r in rows if r["method"] == "greedy"}
    for r in rows:
        r["vs_greedy_same_batch"] = r["tokens_per_second"] / base[r["batch_size"]]
        r["vs_greedy_batch_1"] = r["tokens_per_second"] / base[min(base)]
    return rows, notes


def run(
    *,
    target: str = "smollm2-135m-instruct",
    drafter: Annotated[str | None, "a learned drafter directory (the combined method's)"] = None,
    methods: tuple[str, ...] = ("greedy", "lookup"),
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    max_new_tokens: int = 64,
    rounds: Annotated[int, "timed batches per method and size (the median is reported)"] = 1,
    compile: Literal["auto", "true", "false"] = "auto",
    profile: Annotated[Path | None, "this machine's profile of the target (the tree search's profile.json)"] = None,
    tree: Annotated[str, "the tree lookup and combined decode with (a preset or a tree file)"] = "dynamic",
    backend: str = "auto",
    dtype: Literal["float32", "bfloat16"] = "float32",
    pack: Annotated[Literal["true", "false"], "the eager step packs the rows' nodes (false: pads them)"] = "true",
    prompts: Annotated[int | None, "prompts each batch size B decodes, B rows at a time (None: B, one batch)"] = None,
    threads: int | None = None,
    out: str = "bench_batch.json",
) -> Report:
    """Batched decoding's tokens/s per row and in total against batch size, greedy and speculative, rows checked."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or "greedy" not in methods:
        raise ValueError(f"methods: greedy and any of {METHODS[1:]}, got {list(methods)}")
    if "combined" in methods and drafter is None:
        raise ValueError("the combined method needs a learned drafter: --drafter runs/.../drafter")
    threads = use_threads(threads)
    switch = {"auto": "auto", "true": True, "false": False}[compile]
    lookup = MedusaLikeModel.from_pretrained(
        target, drafter="lookup", backend=backend, compile=switch, profile=profile, dtype=dtype
    )
    lookup.forward.eager.packs = pack == "true"  # the padded forward, as before packing, for comparison
    models = {"greedy": (lookup, "none")}
    if "lookup" in methods:
        models["lookup"] = (lookup, tree)
    if "combined" in methods:
        learned = resolve_drafter("combined", lookup.target, learned=drafter)
        models["combined"] = (MedusaLikeModel(lookup.forward, lookup.tokenizer, learned), tree)
    rows, notes = batch_speed(models, sorted(set(batch_sizes)), max_new_tokens, rounds, prompts)
    cells = [
        [r["method"], str(r["batch_size"]), f"{r['tokens_per_second']:.1f}", f"{r['tokens_per_second_per_row']:.1f}",
         f"{r['vs_greedy_batch_1']:.2f}x", f"{r['vs_greedy_same_batch']:.2f}x", f"{r['tau']:.2f}",
         f"{r['equal_rows']}/{r['prompts']}"]
        for r in rows
    ]  # fmt: skip
    columns = ["method", "batch", "tokens/s total", "tokens/s per row", "vs greedy B=1", "vs greedy same B", "tau"]
    columns.append("rows equal to B=1 greedy")
    title = f"batched decoding, {max_new_tokens} new tokens, {dtype}, {lookup.forward.describe()}, {threads} threads"
    result = {
        "target": target,
        "drafter": drafter,
        "step": lookup.forward.describe(),
        "dtype": dtype,
        "packed": pack == "true",
        "threads": threads,
        "max_new_tokens": max_new_tokens,
        "rounds": rounds,
        "prompts": prompts,
        "rows": rows,
        "not_equal": notes,
    }
    return Report(result, [table(title, columns, cells)], notes or ["every row equals its batch-1 greedy output"], out)
