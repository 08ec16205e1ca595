"""A batch's forward inputs: each row's nodes padded to the widest row, at the row's own positions, under one
[B, 1, T, S] boolean mask over the batch cache's live slots (`kv_cache.BatchTreeKVCache`).

    ids, positions, mask = batch_inputs(cache.lengths, tokens, depths, blocks)    # [B, T], [B, T], [B, 1, T, S]

Row b has `lengths[b]` committed entries in slots 0..lengths[b]-1 and its n_b new nodes go to the slots right after
them; S = max(lengths) + T. Node i of row b sits at position lengths[b] + depths[b][i] and sees its row's committed
slots and the nodes its block names (a tree's ancestors and itself; a prompt chunk's earlier tokens and itself):
nothing of another row. A padding node (i >= n_b) sees only its own slot; its output is never read, and its entry is
overwritten by the row's next forward. A sliding window is applied by the attention backend from the positions this
mask implies (`attention.mask_positions`).
"""

import torch
from torch.nn.utils.rnn import pad_sequence

from .draft_tree import DraftTree


def batch_inputs(
    lengths: list[int], tokens: list[torch.Tensor], depths: list[torch.Tensor], blocks: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row b's nodes `tokens[b]` [n_b] at depths `depths[b]` [n_b] past its committed length, its block `blocks[b]`
    [n_b, n_b] (which node sees which) -> (ids [B, T], positions [B, T], mask [B, 1, T, S])."""
    device = tokens[0].device
    rows, width = len(tokens), max(t.numel() for t in tokens)
    ids = pad_sequence(tokens, batch_first=True)  # [B, T], padding 0
    base = torch.tensor(lengths, device=device)  # [B]
    positions = base[:, None] + pad_sequence(depths, batch_first=True)  # [B, T]: padding at the row's length
    block = torch.eye(width, dtype=torch.bool, device=device).repeat(rows, 1, 1)  # [B, T, T]
    for row, seen in enumerate(blocks):
        block[row, : seen.shape[0], : seen.shape[1]] = seen
    counts = torch.tensor([t.numel() for t in tokens], device=device)  # [B]
    live = max(lengths) + width  # S
    committed = torch.arange(live, device=device)[None] < base[:, None]  # [B, S]
    real = torch.arange(width, device=device)[None] < counts[:, None]  # [B, T]
    visible = committed[:, None, :] & real[:, :, None]  # [B, T, S]
    slots = (base[:, None] + torch.arange(width, device=device))[:, None, :].expand(rows, width, width)  # [B, T, T]
    visible.scatter_(2, slots, block)  # node j of row b sits in slot lengths[b] + j
    return ids, positions, visible[:, None]


def tree_inputs(lengths: list[int], drafts: list[DraftTree]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tree step of a batch: row b verifies `drafts[b]`, each node seeing its committed prefix and ancestors."""
    return batch_inputs(
        lengths, [d.tokens for d in drafts], [d.depth for d in drafts], [d.attention_mask for d in drafts]
    )


def chunk_inputs(lengths: list[int], chunks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of a batch's prefill: row b reads the next `chunks[b]` [n_b] tokens of its prompt, causally."""
    depths = [torch.arange(c.numel(), device=c.device) for c in chunks]
    blocks = [torch.ones(c.numel(), c.numel(), dtype=torch.bool, device=c.device).tril() for c in chunks]
    return batch_inputs(lengths, chunks, depths, blocks)
