"""Drafting benchmark: what one EAGLE-3 drafting step costs, per step and per drafting depth, on the default target.

    python -m eval.bench draft                                  # a random-init drafter for the default target
    python -m eval.bench draft --drafter runs/make_run/train/drafter
    python -m eval.bench draft --steps 80 --threads 2 --out bench_draft.json
    python -m eval.bench draft --linears nn.Linear              # without the few-row layers decoding gives it
    python -m eval.bench draft --linears compiled               # its level compiled, as on the compiled step
    python -m eval.bench draft --drafter-dtype float32          # the drafter in the target's fp32 (default: auto)

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

import hashlib
import statistics
import time
from typing import Annotated, Literal

import torch

from medusa_like.decoding.step import EagerStep
from medusa_like.decoding.tree import DynamicTreeSpec, TokenTree
from medusa_like.decoding.tree_presets import chain
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.drafters.eagle3_proposer import Eagle3Proposer
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.forward.cpu.few_row_linear import use_few_row_linears
from medusa_like.forward.prepared import PreparedTarget
from medusa_like.targets import DEFAULT_TARGET

from .harness import Report, load, table, timed, use_threads

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
    target_step = EagerStep(target)
    cache = target_step.new_cache(prompt_len)
    positions = torch.arange(prompt_len)[None]
    logits, features = target_step.forward(
        prompt_ids[None], positions, None, cache, layers, last=True
    )  # [1, V], [P, F]
    root = logits[0].argmax(-1)
    proposer.begin(prompt_ids, features, root, prompt_len + 3 * (warmup + steps) + 1)
    digest, times, cpu_times = hashlib.sha256(), [], []
    for step in range(warmup + steps):
        cpu_start = time.process_time()
        ms, tree = timed(lambda: proposer.propose(spec))
        if step >= warmup:
            times.append(ms)
            cpu_times.append(1000 * (time.process_time() - cpu_start))
        digest.update(tree.tokens.numpy().tobytes() + tree.parents.numpy().tobytes())
        path = tree.retrieve[0][tree.retrieve[0] >= 0]  # the first leaf's path, root first
        nodes = path[: 1 + step % 3]  # [a + 1]: 0, 1 or 2 drafted tokens accepted
        accepted = nodes.numel() - 1
        rows = torch.arange(step, step + accepted + 1) % prompt_len  # any target features: cost only
        proposer.accept(tree.tokens[nodes], features[rows], tree.tokens[nodes[-1]])
    step_ms = statistics.median(times)
    return {
        "depth": spec.max_depth,
        "ms_per_step": step_ms,
        "ms_per_depth": step_ms / spec.max_depth,
        "ms_per_step_p10": statistics.quantiles(times, n=10)[0],
        "cpu_ms_per_step": statistics.median(cpu_times),
        "drafts": digest.hexdigest()[:16],
    }


def run(
    *,
    target: str = DEFAULT_TARGET,
    drafter: Annotated[str | None, "a trained EAGLE-3 drafter; default: random init"] = None,
    draft_vocab: Annotated[int, "random drafter's draft vocabulary"] = DRAFT_VOCAB,
    steps: int = 60,
    warmup: int = 5,
    threads: int = 2,
    seed: int = 0,
    trees: Annotated[tuple[str, ...], f"of {list(TREES)}"] = tuple(TREES),
    linears: Annotated[
        Literal["few_row", "nn.Linear", "compiled"],
        "few_row: the layers the decoding loop gives target and drafter on CPUs (this CPU's kernels); compiled: the "
        "drafter's level compiled as decoding on the compiled step runs it (forward/compiled_draft.py)",
    ] = "few_row",
    drafter_dtype: Annotated[
        str, "what the drafter computes in, as decoding casts it (PreparedTarget.drafting_dtype): auto, or a dtype name"
    ] = "auto",
    out: str = "bench_draft.json",
) -> Report:
    """What one EAGLE-3 drafting step costs, per step and per drafting depth, for four tree shapes."""
    unknown = sorted(set(trees) - set(TREES))
    if unknown:
        raise ValueError(f"trees: unknown {unknown}; known: {list(TREES)}")
    use_threads(threads)
    target_model, tokenizer, loaded = load(target, drafter=drafter)
    eagle3 = loaded if loaded is not None else random_drafter(target_model, draft_vocab, seed)
    if eagle3.kind != "eagle3":
        raise ValueError(f"drafter {drafter!r} is not an EAGLE-3 drafter (a {eagle3.kind} drafter)")
    prepared = PreparedTarget(target_model, "auto", tuned_layers=linears == "few_row")
    dtype = prepared.drafting_dtype(eagle3, drafter_dtype)
    eagle3 = eagle3.to(dtype=dtype)
    if linears == "few_row":
        use_few_row_linears(target_model)
        use_few_row_linears(eagle3, fp32_kernel=False)  # as `PreparedTarget.adopt` swaps a drafter's
    if linears == "compiled":  # compiled (or loaded) on the first step, which the warm-up steps leave untimed
        prepared.use_compiled(True)
        prepared.compile_drafting(eagle3)
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids[0]
    with torch.inference_mode():
        results = {name: bench_tree(target_model, eagle3, prompt_ids, TREES[name], steps, warmup) for name in trees}
    keys = ("ms_per_step", "ms_per_depth", "ms_per_step_p10", "cpu_ms_per_step")
    shown = table(
        f"EAGLE-3 drafting, {target}, {linears} layers, drafter in {dtype}, {torch.get_num_threads()} threads",
        ["tree", "depth", "ms/step", "ms/depth", "p10 ms/step", "cpu ms/step", "drafts"],
        [[name, str(r["depth"]), *(f"{r[k]:.2f}" for k in keys), r["drafts"]] for name, r in results.items()],
    )
    result = {
        "target": target,
        "linears": linears,
        "drafter_dtype": str(dtype),
        "drafter": drafter or f"random init, draft vocabulary {eagle3.config.draft_vocab_size}",
        "draft_vocab_size": eagle3.config.draft_vocab_size,
        "torch_threads": torch.get_num_threads(),
        "steps": steps,
        "seed": seed,
        "trees": results,
    }
    return Report(result, [shown], out=out)
