"""Drafting benchmark: what one EAGLE-3 drafting step costs, per step and per drafting depth, on the default target.

    python -m eval.bench_draft                                  # a random-init drafter for the default target
    python -m eval.bench_draft --drafter runs/make_run/train/drafter
    python -m eval.bench_draft --steps 80 --threads 2 --out bench_draft.json
    python -m eval.bench_draft --linears nn.Linear              # without the few-row layers decoding gives it
    python -m eval.bench_draft --drafter-dtype float32          # the drafter in the target's fp32 (default: auto)

Each tree (dynamic d2k4n4, d4k4n8, d5k6n16 and a chain of 4) is drafted for `--steps` steps after a real prompt: the
target's own features of the prompt start the drafter, then every step proposes a tree and accepts a path of 0-2
drafted nodes (their features are the prompt's, reused: the drafter's cost does not depend on their values). A step
is `propose` as the decoding loop calls it: committing the accepted entries, then one drafter pass per depth. Times
are medians over the steps after a warm-up; ms per depth is the step's median over the tree's depth. On a shared
machine the wall-clock figures swing with the load: the 10th percentile and the process's CPU time per step (all
threads together) are steadier.

`drafts` is a digest of every proposed tree's tokens and parents: two versions of the drafter's code that draft the
same trees print the same digest (same drafter weights, same --seed and --steps).
"""

import argparse
import hashlib
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from medusa_like.decoding.step import EagerStep
from medusa_like.decoding.tree import DynamicTreeSpec, TokenTree
from medusa_like.decoding.tree_presets import chain
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Proposer
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.formats import load_drafter
from medusa_like.forward.cpu.few_row_linear import use_few_row_linears
from medusa_like.forward.prepared import PreparedTarget
from medusa_like.io import write_json
from medusa_like.targets import DEFAULT_TARGET, load_target

PROMPT = (
    "Explain how a hash map works, in a few paragraphs: hashing, buckets, collisions, resizing, and what makes "
    "lookups fast on average but slow in the worst case. Then compare it with a balanced binary search tree."
)
TREES = {
    "d2k4n4": DynamicTreeSpec(depth=2, top_k=4, num_nodes=4),
    "d4k4n8": DynamicTreeSpec(depth=4, top_k=4, num_nodes=8),
    "d5k6n16": DynamicTreeSpec(depth=5, top_k=6, num_nodes=16),
    "chain4": TokenTree.from_paths(chain(4)),
}
DRAFT_VOCAB = 8192  # conf/drafter/eagle3.yaml's draft_vocab_size


def random_drafter(target, draft_vocab_size: int, seed: int) -> Eagle3Drafter:
    """A random-init drafter for `target` over a random draft vocabulary of `draft_vocab_size` tokens."""
    torch.manual_seed(seed)
    vocab_size = target.config.get_text_config().vocab_size
    size = min(draft_vocab_size, vocab_size)
    vocab = DraftVocab(torch.randperm(vocab_size)[:size].sort().values, vocab_size)
    return Eagle3Drafter(Eagle3Config.for_target(target.config, size), vocab).eval()


def bench_tree(target, drafter, prompt_ids: torch.Tensor, spec, steps: int, warmup: int) -> dict:
    """Median ms of `propose` per step over `steps` simulated decoding steps, and a digest of the trees drafted."""
    proposer = Eagle3Proposer(drafter, target)
    layers = proposer.feature_layers
    prompt_len = prompt_ids.numel()
    step = EagerStep(target)
    cache = step.new_cache(prompt_len)
    positions = torch.arange(prompt_len)[None]
    logits, features = step.forward(prompt_ids[None], positions, None, cache, layers, last=True)  # [1, V], [P, F]
    root = logits[0].argmax(-1)
    proposer.begin(prompt_ids, features, root, prompt_len + 3 * (warmup + steps) + 1)
    digest, times, cpu_times = hashlib.sha256(), [], []
    for step in range(warmup + steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        tree = proposer.propose(spec)
        if step >= warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        digest.update(tree.tokens.numpy().tobytes() + tree.parents.numpy().tobytes())
        path = tree.retrieve[0][tree.retrieve[0] >= 0]  # the first leaf's path, root first
        nodes = path[: 1 + step % 3]  # [a + 1]: 0, 1 or 2 drafted tokens accepted
        accepted = nodes.numel() - 1
        rows = torch.arange(step, step + accepted + 1) % prompt_len  # any target features: cost only
        proposer.accept(tree.tokens[nodes], features[rows], tree.tokens[nodes[-1]])
    step_ms = 1000 * statistics.median(times)
    return {
        "depth": spec.max_depth,
        "ms_per_step": step_ms,
        "ms_per_depth": step_ms / spec.max_depth,
        "ms_per_step_p10": 1000 * statistics.quantiles(times, n=10)[0],
        "cpu_ms_per_step": 1000 * statistics.median(cpu_times),
        "drafts": digest.hexdigest()[:16],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", default=None, help="a trained EAGLE-3 drafter; default: random init")
    parser.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB, help="random drafter's draft vocabulary")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trees", nargs="*", default=list(TREES), choices=list(TREES))
    parser.add_argument(
        "--linears",
        default="few_row",
        choices=["few_row", "nn.Linear"],
        help="few_row: the row-planned layers the decoding loop gives target and drafter on fp32 CPUs",
    )
    parser.add_argument(
        "--drafter-dtype",
        default="auto",
        help="what the drafter computes in, as decoding casts it (PreparedTarget.drafting_dtype): auto, or a dtype name",
    )
    parser.add_argument("--out", default="bench_draft.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, dtype=torch.float32, device="cpu")
    drafter = (
        load_drafter(args.drafter, target) if args.drafter else random_drafter(target, args.draft_vocab, args.seed)
    )
    if drafter.kind != "eagle3":
        raise ValueError(f"--drafter {args.drafter!r} is not an EAGLE-3 drafter (a {drafter.kind} drafter)")
    dtype = PreparedTarget(target, "auto", tuned_layers=args.linears == "few_row").drafting_dtype(
        drafter, args.drafter_dtype
    )
    drafter = drafter.to(dtype=dtype)
    if args.linears == "few_row":
        use_few_row_linears(target)
        use_few_row_linears(drafter)
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids[0]
    results = {}
    with torch.inference_mode():
        for name in args.trees:
            results[name] = bench_tree(target, drafter, prompt_ids, TREES[name], args.steps, args.warmup)

    table = Table(
        title=f"EAGLE-3 drafting, {args.target}, {args.linears} layers, drafter in {dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    for column in ("tree", "depth", "ms/step", "ms/depth", "p10 ms/step", "cpu ms/step", "drafts"):
        table.add_column(column, no_wrap=True)
    for name, row in results.items():
        table.add_row(
            name,
            str(row["depth"]),
            f"{row['ms_per_step']:.2f}",
            f"{row['ms_per_depth']:.2f}",
            f"{row['ms_per_step_p10']:.2f}",
            f"{row['cpu_ms_per_step']:.2f}",
            row["drafts"],
        )
    Console(width=120).print(table)
    report = {
        "target": args.target,
        "linears": args.linears,
        "drafter_dtype": str(dtype),
        "drafter": args.drafter or f"random init, draft vocabulary {drafter.config.draft_vocab_size}",
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "torch_threads": torch.get_num_threads(),
        "steps": args.steps,
        "seed": args.seed,
        "trees": results,
    }
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
