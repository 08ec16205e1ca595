"""Batched decoding: B prompts at once, one target forward per step for all of them, each row decoded exactly as it
would be alone (`generate.decode`).

    outputs = decode_batch(step, proposers, prompts, tree, max_new_tokens, capacity, stops, sampling, generators,
                           batch_size=8)

At most `batch_size` rows decode at once (continuous batching): the other prompts wait, in order, and a finished row's
place goes to the next of them, read in a prefill of its own and appended to the batch's cache (`cache.extend`), so
the batch stays full while prompts wait instead of lasting as long as its slowest row.

Prefill reads the prompts in chunks of at most `prefill_chunk_size` tokens per forward, right-padded and masked; the
cache's rows are ordered by prompt length, longest first, so a chunk covers only the rows still reading their prompt.
Then one step:

    propose     each unfinished row's tree, from its own proposer                                DraftTree [n_b]
    verify      one target forward over every row's nodes, padded to the widest row (`batch_inputs.py`):
                per-row positions, a [B, 1, T, S] mask: a row sees its committed prefix and its own
                tree's ancestors, nothing of another row; padding nodes see only themselves  -> logits [B, T, V]
                (a step that packs computes the real nodes alone: `step.TargetStep.packs`)
    accept      each row its own path (`generate.accept_greedy`), its tokens picked by its own noise
    commit      each row's accepted nodes' KV to its own committed slots (one gather and scatter per layer)
    finish      a row that stopped (EOS, a stop string, max_new_tokens) leaves the batch: its cache row is
                dropped, the other rows go on as before, and waiting prompts join (`admit`)

A row's tokens equal its batch-1 tokens because nothing of another row reaches it: its attention sees its own slots
only, its positions are its own, its acceptance and sampling noise (`Row`, a generator per row) are its own. What can
differ is rounding: a product over B x T rows or an attention over a longer, masked key range may round otherwise than
over one row's, as a tree step may against one-node decoding (docs/decoding.md). Where the step's products and
attention are row-invariant (the compiled CPU step; the eager one on the `rows` attention and the fp32 kernel, up to
its row count), a row's decode steps get exactly its batch-1 bits.

Rows that size their trees by a cost model (lookup, combined) are told what the other rows verify in the same forward
(`tree.in_batch`, `cost_model.BatchShare`): the other rows' widest tree, their nodes and their expected tokens, from
their last step, and whether the step packs the rows' nodes or pads them to the widest.
"""

import time

import torch

from .batch_inputs import chunk_inputs, tree_inputs
from .cost_model import BatchShare
from .draft_tree import DraftTree
from .generate import GenerateOutput, Row, StopChecker, accept_greedy, vocab_size
from .sampling import PositionNoise
from .step import TargetStep
from .tree import in_batch

PREFILL_CHUNK_SIZE = 2048  # prompt tokens a prefill forward reads, over all its rows


@torch.inference_mode()
def decode_batch(
    step: TargetStep,
    proposers: list,
    prompts: list[torch.Tensor],
    tree,
    max_new_tokens: int,
    capacity: int,
    stops: list[StopChecker | None] | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generators: list[torch.Generator | None] | None = None,
    prefill_chunk_size: int = PREFILL_CHUNK_SIZE,
    batch_size: int | None = None,
) -> list[GenerateOutput]:
    """Decode `prompts` ([1, T_b] each), row b with `proposers[b]`, `stops[b]` and `generators[b]`, on arguments
    `checks.check_batch` accepted (`capacity`: its answer); one `GenerateOutput` per prompt, in order. At most
    `batch_size` rows (None: every prompt) decode at once; the other prompts wait, in order, and are read into the
    batch as rows finish (`admit`)."""
    count, device = len(prompts), prompts[0].device
    stops, generators = stops or [None] * count, generators or [None] * count
    tree, layers = tree.to(device), proposers[0].feature_layers
    noise = [None if temperature == 0 else PositionNoise(vocab_size(step), device, g) for g in generators]
    rows = [
        Row(prompt[0], max_new_tokens, stop, (temperature, top_k, top_p), row_noise)
        for prompt, stop, row_noise in zip(prompts, stops, noise, strict=True)
    ]
    waiting, batch_size = list(range(count)), batch_size or count
    cache, live = None, []  # live[i]: the row in the cache's row i
    started = [0.0] * count  # when each row's decoding began (after its prefill)
    widths, gains = [1] * count, [1.0] * count  # each row's last tree (nodes) and tokens, for budgeted trees
    while live or waiting:
        kept = [i for i, b in enumerate(live) if not rows[b].done]
        for b in set(live) - {live[i] for i in kept}:  # finished: the row leaves the batch
            rows[b].stats.decode_seconds = time.perf_counter() - started[b]
        if len(kept) < len(live):
            live = [live[i] for i in kept]
            if live:
                cache.keep(kept)
            else:  # every row done: the next prompts start a cache of their own
                cache = None
            continue
        if waiting and len(live) < batch_size:  # free rows: the next prompts join the batch
            joining, waiting = waiting[: batch_size - len(live)], waiting[batch_size - len(live) :]
            joined, read = admit(step, proposers, rows, prompts, joining, capacity, layers, prefill_chunk_size)
            cache = read if cache is None else cache.extend(read)
            live += joined
            for b in joined:
                started[b] = time.perf_counter()
            continue  # a row whose first token ends it leaves at once
        drafts = propose(proposers, rows, live, tree, widths, gains, step.packs)
        step_start = time.perf_counter()
        ids, positions, mask = tree_inputs(cache.lengths, drafts)  # [B, T], [B, T], [B, 1, T, S]
        cache.check_room(ids.shape[1])
        nodes = [draft.num_nodes for draft in drafts]
        logits, features = step.forward_batch(ids, positions, mask, cache, layers, nodes=nodes)  # [B, T, V], [B, T, F]
        accepted = []
        for i, (b, draft) in enumerate(zip(live, drafts, strict=True)):
            predictions = rows[b].pick(logits[i, : draft.num_nodes], draft.depth, draft.max_depth)  # [n_b]
            nodes = accept_greedy(draft.tokens, predictions, draft)  # [a + 1]
            root = predictions[nodes[-1]]
            proposers[b].accept(draft.tokens[nodes], features[i, nodes], root)
            rows[b].record(draft, nodes, root)
            accepted.append(nodes)
            widths[b], gains[b] = draft.num_nodes, float(nodes.numel())
        cache.commit(accepted)
        verified = time.perf_counter() - step_start  # the batch's forward, acceptance and commits: every row's
        for b in live:
            rows[b].stats.verify_seconds += verified
    return [row.output() for row in rows]


def admit(
    step: TargetStep,
    proposers: list,
    rows: list[Row],
    prompts: list,
    joining: list[int],
    capacity: int,
    layers,
    chunk_size: int,
) -> tuple[list[int], object]:
    """Read the prompts of rows `joining` into a cache of their own (its rows ordered longest prompt first), pick
    each row's first token and begin its proposer -> (the rows in that cache's order, the cache: the batch's cache
    `extend`s by it)."""
    order = sorted(joining, key=lambda b: -prompts[b].shape[1])
    cache = step.new_batch_cache(len(order), capacity)
    start = time.perf_counter()
    logits, features = prefill(step, cache, [prompts[b][0] for b in order], layers, chunk_size)
    zero = torch.zeros(1, dtype=torch.long, device=logits.device)
    for i, b in enumerate(order):
        root = rows[b].pick(logits[i : i + 1], zero, 0)[0]
        proposers[b].begin(prompts[b][0], features[i], root, capacity)
        rows[b].start(root)
    for b in order:
        rows[b].stats.prefill_seconds = time.perf_counter() - start
    return order, cache


def propose(
    proposers: list, rows: list[Row], live: list[int], tree, widths: list[int], gains: list[float], packed: bool
) -> list:
    """Each live row's tree from its own proposer, a budgeted one told what the other rows verify beside it (their
    widest tree, their nodes and their tokens, as of their last step; `packed`: whether the step computes their
    nodes alone or pads them to the widest)."""
    drafts: list[DraftTree] = []
    total, nodes = sum(gains[b] for b in live), sum(widths[b] for b in live)
    ranked = sorted(live, key=lambda b: -widths[b])[:2]  # the widest rows: the widest among the others of any row
    for b in live:
        start = time.perf_counter()
        widest = next((widths[o] for o in ranked if o != b), 1)
        share = BatchShare(len(live) - 1, widest, total - gains[b], nodes - widths[b], packed)
        drafts.append(proposers[b].propose(in_batch(tree, share)))
        rows[b].stats.draft_seconds += time.perf_counter() - start
    return drafts


def prefill(step: TargetStep, cache, prompts: list[torch.Tensor], layers, chunk_size: int):
    """Read `prompts` ([P_b] each, longest first: the cache's row order) into `cache` in chunks of at most
    `chunk_size` tokens per forward -> (the logits after each prompt [B, V], the features of every prompt position,
    [P_b, F] per row)."""
    lengths = [p.numel() for p in prompts]
    last: list = [None] * len(prompts)
    features: list[list[torch.Tensor]] = [[] for _ in prompts]
    start = 0
    while start < lengths[0]:
        reading = sum(length > start for length in lengths)  # a prefix of the rows: longest first
        width = max(1, chunk_size // reading)  # tokens per row in this chunk
        chunks = [prompts[b][start : start + width] for b in range(reading)]
        ids, positions, mask = chunk_inputs(cache.lengths[:reading], chunks)  # [R, T], [R, T], [R, 1, T, S]
        cache.check_room(ids.shape[1], reading)
        ends = torch.tensor([c.numel() - 1 for c in chunks], device=ids.device)  # [R]
        logits, states = step.forward_batch(ids, positions, mask, cache, layers, last=ends)  # [R, V], [R, T, F]
        cache.commit_all([c.numel() for c in chunks])
        for b, chunk in enumerate(chunks):
            features[b].append(states[b, : chunk.numel()])
            if start + chunk.numel() == lengths[b]:
                last[b] = logits[b]
        start += width
    return torch.stack(last), [torch.cat(f) for f in features]
