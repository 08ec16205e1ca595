"""First-call benchmark: what a new user's first `generate` costs against transformers' greedy `generate`.

    python -m eval.bench_first_call                                   # the default target and a Gemma3-270M shape
    python -m eval.bench_first_call --targets default --max-new-tokens 16 --threads 1 --out bench_first_call.json

Each target runs in a fresh process with an empty cache directory (`$MEDUSA_LIKE_CACHE_DIR`: no row plans, no cost
model), as on a new machine: transformers' greedy `generate` twice (the model as it was loaded), then
`MedusaLikeModel.from_pretrained(model)` with default settings (lookup drafter, dynamic tree, few-row layers) and its
first and second `generate` on the same prompt (the first not remembered, so that the second drafts from no more than
the first did). Every call makes exactly `--max-new-tokens` tokens (no EOS). The targets: "default" (the embedded
SmolLM2-135M-Instruct, `targets.load_target`, on a chat prompt) and "gemma3-270m" (random weights in Gemma3-270M's
shape, 262k-token vocabulary, built from a config: nothing downloaded; a prompt of random token ids). Prints the table
and writes JSON.
"""

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table

from medusa_like.io import write_json

TARGETS = ("default", "gemma3-270m")
QUESTION = "Explain how a hash map works, in a few paragraphs."


def gemma3_270m():
    """A frozen fp32 model of Gemma3-270M's shape with random weights, and no tokenizer."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

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
        from medusa_like.targets import chat_input_ids, load_target

        model, tokenizer = load_target(default_dir)
        return model, tokenizer, chat_input_ids(tokenizer, [{"role": "user", "content": QUESTION}])
    model, tokenizer = gemma3_270m()
    prompt = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    return model, tokenizer, prompt


def seconds(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def one_target(name: str, default_dir: str | None, max_new_tokens: int) -> dict:
    """The timings of one target, in this process (run by `main` in a fresh one)."""
    from medusa_like.model import MedusaLikeModel

    model, tokenizer, ids = load(name, default_dir)
    greedy = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    mask = torch.ones_like(ids)
    greedy_s = [seconds(lambda: model.generate(ids, attention_mask=mask, **greedy))[0] for _ in range(2)]
    construct_s, ours = seconds(lambda: MedusaLikeModel.from_pretrained(model, tokenizer=tokenizer))
    calls = [
        seconds(lambda r=remember: ours.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=[], remember=r))
        for remember in (False, True)
    ]
    cost = ours.cost_model
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
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {TARGETS}")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default="bench_first_call.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one target in this process, print its JSON
    parser.add_argument("--default-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.one:
        logging.basicConfig(level=logging.INFO, format="%(message)s")  # what the first call measures, and why
        print(json.dumps(one_target(args.one, args.default_dir, args.max_new_tokens)))
        return {}
    names = args.targets.split(",")
    unknown = set(names) - set(TARGETS)
    if unknown:
        parser.error(f"--targets: unknown {sorted(unknown)}; known: {list(TARGETS)}")
    from medusa_like.targets import DEFAULT_TARGET, resolve_target

    default_dir = resolve_target(DEFAULT_TARGET) if "default" in names else None  # converted once, in the user cache
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="bench_first_call_") as cache:
            command = [sys.executable, "-m", "eval.bench_first_call", "--one", name]
            command += ["--max-new-tokens", str(args.max_new_tokens), "--default-dir", str(default_dir)]
            command += [] if args.threads is None else ["--threads", str(args.threads)]
            env = {**os.environ, "MEDUSA_LIKE_CACHE_DIR": cache}
            done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))

    table = Table(title=f"first calls, {args.max_new_tokens} new tokens, s ({torch.get_num_threads()} threads)")
    for column in ("target", "greedy 1st", "greedy 2nd", "from_pretrained", "ours 1st", "ours 2nd", "1st / greedy"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["target"],
            *(f"{s:.2f}" for s in (*r["greedy_s"], r["construct_s"], *r["generate_s"])),
            f"{r['first_over_greedy']:.2f}",
        )
    console = Console(width=160)
    console.print(table)
    for r in rows:
        console.print(f"{r['target']}: {r['cost_model']['description'] if r['cost_model'] else 'no cost model'}")
    result = {"max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(), "targets": rows}
    write_json(args.out, result)
    console.print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
