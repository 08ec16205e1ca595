"""First-call benchmark: what a new user's first `generate` costs against transformers' greedy `generate`.

    python -m eval.bench first_call                                   # the default target and a Gemma3-270M shape
    python -m eval.bench first_call --targets default --max-new-tokens 16 --threads 1 --out bench_first_call.json
    python -m eval.bench first_call --targets default --compile --threads 2   # compiled: a first and a later process

Each target runs in a fresh process with an empty cache directory (`$MEDUSA_LIKE_CACHE_DIR`: no cost model), as on a new machine: transformers' greedy `generate` twice (the model as it was loaded), then
`MedusaLikeModel.from_pretrained(model)` with default settings (lookup drafter, dynamic tree, few-row layers) and its
first and second `generate` on the same prompt (the first not remembered, so that the second drafts from no more than
the first did). Every call makes exactly `--max-new-tokens` tokens (no EOS). The targets: "default" (the embedded
SmolLM2-135M-Instruct, `targets.load_target`, on a chat prompt) and "gemma3-270m" (random weights in Gemma3-270M's
shape, 262k-token vocabulary, built from a config: nothing downloaded; a prompt of random token ids).

`--compile` asks for the compiled step (`compile=True`) and runs each target in two fresh processes that share one
empty cache directory: the first compiles the step on its first call, the second (a later process) loads what the
first saved; each row's first call is from `from_pretrained` to its tokens.

The fresh process runs this module (`python -m benchmarks.first_call <target> <default dir> <new tokens>
<threads>`), which prints one target's figures as JSON.
"""

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from medusa_like.model import MedusaLikeModel
from medusa_like.targets import DEFAULT_TARGET, chat_input_ids, load_target, resolve_target

from .harness import Report, table, timed, use_threads

CHECKOUT = (
    Path(__file__).resolve().parents[1]
)  # where `benchmarks` imports from (a checkout's package, not the wheel's)

TARGETS = ("default", "gemma3-270m")
QUESTION = "Explain how a hash map works, in a few paragraphs."


def gemma3_270m():
    """A frozen fp32 model of Gemma3-270M's shape with random weights, and no tokenizer."""
    config = Gemma3TextConfig(
        vocab_size=262_144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        max_position_embeddings=32_768,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False), None


def load(name: str, default_dir: str | None):
    """(model, tokenizer, prompt ids [1, T]) of a benchmark target."""
    if name == "default":
        model, tokenizer = load_target(default_dir)
        return model, tokenizer, chat_input_ids(tokenizer, [{"role": "user", "content": QUESTION}])
    model, tokenizer = gemma3_270m()
    prompt = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    return model, tokenizer, prompt


def seconds(fn) -> tuple[float, object]:
    ms, result = timed(fn)
    return ms / 1000, result


def one_target(name: str, default_dir: str | None, max_new_tokens: int, compile: bool = False) -> dict:
    """The timings of one target, in this process (run by `run` in a fresh one)."""
    model, tokenizer, ids = load(name, default_dir)
    greedy = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    mask = torch.ones_like(ids)
    greedy_s = [seconds(lambda: model.generate(ids, attention_mask=mask, **greedy))[0] for _ in range(2)]
    construct_s, ours = seconds(lambda: MedusaLikeModel.from_pretrained(model, tokenizer=tokenizer, compile=compile))
    calls = [
        seconds(lambda r=remember: ours.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=[], remember=r))
        for remember in (False, True)
    ]
    cost = ours.drafter.cost_model  # what the lookup drafter sized its trees by
    return {
        "target": name,
        "vocab_size": model.config.get_text_config().vocab_size,
        "prompt_tokens": ids.shape[1],
        "greedy_s": greedy_s,
        "construct_s": construct_s,
        "generate_s": [s for s, _ in calls],
        "tau": [out.stats.tau for _, out in calls],
        "first_over_greedy": calls[0][0] / greedy_s[0],
        "cost_model": None if cost is None else {"description": cost.describe(), "note": cost.note},
        "step": ours.forward.step.describe(),
    }


def in_fresh_process(name: str, default_dir, max_new_tokens: int, threads: int | None, cache: str, compile: bool):
    """`one_target` in a new Python process with the cache directory `cache`."""
    command = [sys.executable, "-m", __name__, name, str(default_dir or ""), str(max_new_tokens), str(threads or "")]
    path = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "MEDUSA_LIKE_CACHE_DIR": cache, "PYTHONPATH": path}
    done = subprocess.run([*command, str(int(compile))], env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_target_afresh(name: str, default_dir, max_new_tokens: int, threads: int | None, compile: bool) -> list[dict]:
    """`one_target` in a fresh process with an empty cache directory; compiled, then again in a later process with
    the cache the first left."""
    labels = [f"{name} compiled (first process)", f"{name} compiled (later process)"] if compile else [name]
    with tempfile.TemporaryDirectory(prefix="bench_first_call_") as cache:
        rows = [in_fresh_process(name, default_dir, max_new_tokens, threads, cache, compile) for _ in labels]
    for row, label in zip(rows, labels, strict=True):
        row["label"] = label
    return rows


def run(
    *,
    targets: Annotated[tuple[str, ...], f"of {TARGETS}"] = TARGETS,
    max_new_tokens: int = 32,
    threads: Annotated[int | None, "torch threads (default: torch's)"] = None,
    compile: Annotated[bool, "the compiled step: a first process, then a later one"] = False,
    out: str = "bench_first_call.json",
) -> Report:
    """A new user's first calls against transformers' greedy generate, each target in fresh processes.

    One process a target; compiled, two: the second reuses what the first compiled."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"targets: unknown {unknown}; known: {list(TARGETS)}")
    use_threads(threads)
    default_dir = resolve_target(DEFAULT_TARGET) if "default" in targets else None  # converted once, in the user cache
    rows = [row for name in targets for row in one_target_afresh(name, default_dir, max_new_tokens, threads, compile)]
    columns = ["target", "greedy 1st", "greedy 2nd", "from_pretrained", "ours 1st", "ours 2nd", "1st / greedy"]
    cells = [
        [
            r["label"],
            *(f"{s:.2f}" for s in (*r["greedy_s"], r["construct_s"], *r["generate_s"])),
            f"{r['first_over_greedy']:.2f}",
        ]
        for r in rows
    ]
    title = f"first calls, {max_new_tokens} new tokens, s ({torch.get_num_threads()} threads)"
    notes = [
        f"{r['label']}: {r['step']}; {r['cost_model']['description'] if r['cost_model'] else 'no cost model'}"
        for r in rows
    ]
    result = {"max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(), "compile": compile, "targets": rows}
    return Report(result, [table(title, columns, cells)], notes, out=out)


if __name__ == "__main__":  # the fresh process of `in_fresh_process`
    name, default_dir, max_new_tokens, threads, compile = sys.argv[1:]
    use_threads(int(threads) if threads else None)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # what the first call measures, and why
    print(json.dumps(one_target(name, default_dir or None, int(max_new_tokens), bool(int(compile)))))
