"""Lookup benchmark: what one lookup drafting step costs with a large output store (it must stay small beside a
target forward, or lookup's drafts stop paying).

    python -m eval.bench lookup                          # 100k tokens of ShareGPT answers, the default tokenizer
    python -m eval.bench lookup --store-tokens 200000 --steps 400 --out bench_lookup.json

The store is filled with assistant answers of ShareGPT conversations (tokenised by the default target's tokenizer),
the context with another conversation's text; then each step proposes a merged, budgeted tree from the context and
the store (`CombinedProposer.propose`: both lookups, calibration, scoring, the budget and the tree's compilation) and
accepts a path of 0-2 drafted nodes, as the decoding loop does. Times are medians over the steps.
"""

import statistics
from typing import Annotated

import torch

from medusa_like.data.sources import load_conversations
from medusa_like.decoding.cost_model import CostModel
from medusa_like.decoding.tree import BudgetedTreeSpec
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.drafters.lookup_sources import OutputStore
from medusa_like.forward.cpu.machine import machine_identity
from medusa_like.targets import DEFAULT_TARGET, weights_fingerprint

from .harness import Report, load, table, timed


def answers(tokenizer, limit_tokens: int, skip: int = 0):
    """Token ids of ShareGPT assistant turns until `limit_tokens` are gathered."""
    total = 0
    for conversation in load_conversations("sharegpt"):
        for turn in conversation["messages"]:
            if turn["role"] != "assistant":
                continue
            if skip:
                skip -= 1
                continue
            ids = tokenizer(turn["content"], add_special_tokens=False)["input_ids"][:1024]
            yield ids
            total += len(ids)
            if total >= limit_tokens:
                return


def filled_store(tokenizer, store_tokens: int) -> tuple[OutputStore, list[int], float]:
    """(a store of `store_tokens` answer tokens, a 1,500-token context from the answers after them, seconds to fill)."""
    store = OutputStore(max_tokens=2 * store_tokens)

    def fill() -> list[int]:
        documents = list(answers(tokenizer, store_tokens))
        for doc in documents:
            store.add(doc)
        return [t for doc in answers(tokenizer, 1500, skip=len(documents)) for t in doc][:1500]

    ms, context = timed(fill)
    return store, context, ms / 1000


def time_steps(target, store: OutputStore, context: list[int], nodes: int, depth: int, steps: int) -> tuple:
    """(ms of each step, nodes of each step's tree): at most `steps` steps drafting a merged, budgeted tree of
    `nodes` nodes from `context` (its first 300 tokens as the prompt) and `store`, each accepting 0-2 drafted tokens of
    the context's true continuation."""
    sizes = [1, 2, 4, 8, 16, 32]
    times = [75.0 + 2.5 * n for n in sizes]
    identity = dict(machine=machine_identity(), step="eager")
    cost = CostModel(sizes, times, weights_fingerprint(target), str(target.dtype), target.device.type, **identity)
    drafter = LookupDrafter(store, lookup_depth=depth)
    drafter.state.cost_model = cost  # the budget's arithmetic, not a measured machine: timing the lookup only
    proposer = drafter.proposer(target)
    spec = BudgetedTreeSpec(None, nodes, depth)
    prompt = torch.tensor(context[:300])
    proposer.begin(prompt, torch.zeros(prompt.numel(), 1), torch.tensor(context[300]), capacity=4096)
    times, node_counts, position = [], [], 301
    for _ in range(steps):
        ms, tree = timed(lambda: proposer.propose(spec))
        times.append(ms)
        node_counts.append(tree.num_nodes)
        advance = 1 + position % 3  # accept 0-2 drafted tokens: the true continuation of the context
        accepted = torch.tensor(context[position - 1 : position - 1 + advance])  # the root, then accepted drafts
        proposer.accept(accepted, None, torch.tensor(context[position - 1 + advance]))
        position += advance
        if position + 4 >= len(context):
            break
    return times, node_counts


def run(
    *,
    store_tokens: int = 100_000,
    steps: int = 300,
    nodes: Annotated[int, "node budget of the tree"] = 16,
    depth: Annotated[int, "lookup depth"] = 8,
    out: str = "bench_lookup.json",
) -> Report:
    """One lookup drafting step (lookups, calibration, scoring, budget, the tree) with a large output store."""
    target, tokenizer, _ = load(DEFAULT_TARGET, dtype=None, device=None)
    store, context, build_s = filled_store(tokenizer, store_tokens)
    times, node_counts = time_steps(target, store, context, nodes, depth, steps)
    result = {
        "store_tokens": store.num_tokens,
        "store_documents": len(store),
        "build_seconds": build_s,
        "steps": len(times),
        "median_ms_per_step": statistics.median(times),
        "p90_ms_per_step": sorted(times)[int(0.9 * len(times))],
        "mean_nodes": statistics.mean(node_counts),
        "threads": torch.get_num_threads(),
    }
    cells = [[key, f"{value:.3f}" if isinstance(value, float) else str(value)] for key, value in result.items()]
    shown = table("lookup drafting step (context + output store, merged and budgeted)", ["measure", "value"], cells)
    return Report(result, [shown], out=out)
