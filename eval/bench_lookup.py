"""Lookup benchmark: what one lookup drafting step costs with a large output store (it must stay small beside a
target forward, or lookup's drafts stop paying).

    python -m eval.bench_lookup                          # 100k tokens of ShareGPT answers, the default tokenizer
    python -m eval.bench_lookup --store-tokens 200000 --steps 400 --out bench_lookup.json

The store is filled with assistant answers of ShareGPT conversations (tokenised by the default target's tokenizer),
the context with another conversation's text; then each step proposes a merged, budgeted tree from the context and
the store (`CombinedProposer.propose`: both lookups, calibration, scoring, the budget and the tree's compilation) and
accepts a path of 0-2 drafted nodes, as the decoding loop does. Times are medians over the steps.
"""

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from medusa_like.data.sources import load_conversations
from medusa_like.decoding.cost_model import CostModel
from medusa_like.decoding.tree import BudgetedTreeSpec
from medusa_like.drafters.lookup import LookupDrafter, OutputStore
from medusa_like.io import write_json
from medusa_like.targets import DEFAULT_TARGET, load_target, target_fingerprint


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store-tokens", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nodes", type=int, default=16, help="node budget of the tree")
    parser.add_argument("--depth", type=int, default=8, help="lookup depth")
    parser.add_argument("--out", default="bench_lookup.json")
    args = parser.parse_args()

    target, tokenizer = load_target(DEFAULT_TARGET)
    store = OutputStore(max_tokens=2 * args.store_tokens)
    start = time.perf_counter()
    documents = list(answers(tokenizer, args.store_tokens))
    context = [t for doc in answers(tokenizer, 1500, skip=len(documents)) for t in doc][:1500]
    for doc in documents:
        store.add(doc)
    build_s = time.perf_counter() - start

    nodes = [1, 2, 4, 8, 16, 32]
    cost = CostModel(
        nodes, [75.0 + 2.5 * n for n in nodes], target_fingerprint(target.config), str(target.dtype), "cpu"
    )
    drafter = LookupDrafter(store, lookup_depth=args.depth)
    drafter.state.cost_model = cost  # the budget's arithmetic, not a measured machine: timing the lookup only
    proposer = drafter.proposer(target)
    spec = BudgetedTreeSpec(None, args.nodes, args.depth)
    prompt = torch.tensor(context[:300])
    proposer.begin(prompt, torch.zeros(prompt.numel(), 1), torch.tensor(context[300]), capacity=4096)
    times, sizes, position = [], [], 301
    for _ in range(args.steps):
        start = time.perf_counter()
        tree = proposer.propose(spec)
        times.append(1000 * (time.perf_counter() - start))
        sizes.append(tree.num_nodes)
        advance = 1 + position % 3  # accept 0-2 drafted tokens: the true continuation of the context
        accepted = torch.tensor(context[position - 1 : position - 1 + advance])  # the root, then accepted drafts
        proposer.accept(accepted, None, torch.tensor(context[position - 1 + advance]))
        position += advance
        if position + 4 >= len(context):
            break
    result = {
        "store_tokens": store.num_tokens,
        "store_documents": len(store),
        "build_seconds": build_s,
        "steps": len(times),
        "median_ms_per_step": statistics.median(times),
        "p90_ms_per_step": sorted(times)[int(0.9 * len(times))],
        "mean_nodes": statistics.mean(sizes),
        "threads": torch.get_num_threads(),
    }
    table = Table(title="lookup drafting step (context + output store, merged and budgeted)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
