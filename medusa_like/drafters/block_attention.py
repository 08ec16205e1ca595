"""The keys a block drafter's layer attends, the context's and then the block's own: a mask of many blocks that never
forms their masked-out pairs (training's), the attention function that computes it part by part (registered in
transformers' attention interface under ATTENTION, the name the layers' config carries), and the cache that hands
each layer its context keys and values through transformers' Cache interface.

    mask = BlockMask(context, size)               # context [B, R, T]: which context keys each of R rows sees
    out, _ = block_attention(module, q, k, v, mask)   # or, with a dense boolean mask, transformers' SDPA
    cache = PrefixedCache([(keys, values), ...])  # per layer [B, H_kv, S, D], followed by the block's at attention
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = "medusa_like_blocks"  # the layers' attention function


@dataclass(frozen=True)
class BlockMask:
    """Which keys the rows of many blocks see, without the dense mask: row r of block n sees the context keys where
    `context[b, r]` holds and every row of its own block of `size` rows (the block-diagonal part), nothing of another
    block. Training's many blocks per row attend this way; the attention never forms the blocks' masked-out pairs."""

    context: torch.Tensor  # [B, R, T] bool, R = blocks * size
    size: int

    def dense(self) -> torch.Tensor:
        """The same visibility as a dense mask [B, 1, R, T + R] bool (what `forward` takes otherwise)."""
        batch, rows, _ = self.context.shape
        eye = torch.eye(rows // self.size, dtype=torch.bool, device=self.context.device)
        own = eye.repeat_interleave(self.size, 0).repeat_interleave(self.size, 1)  # [R, R] block-diagonal
        return torch.cat([self.context, own.expand(batch, -1, -1)], dim=-1)[:, None]


def block_attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """The layers' attention: with a `BlockMask`, softmax attention over each row's context keys and its own block's
    keys at once (the two parts' scores share one softmax), computed part by part so that the cost follows the keys a
    row sees; with a dense boolean mask (a step at inference), transformers' SDPA. query [B, H, R, D], key and value
    [B, H_kv, T + R, D] (the context's, then the rows') -> ([B, R, H, D], None)."""
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    batch, heads, rows, dim = query.shape
    kv_heads, size = key.shape[1], attention_mask.size
    groups, blocks, width = heads // kv_heads, rows // size, key.shape[2] - rows
    scaling = dim**-0.5 if scaling is None else scaling
    q = query.view(batch, kv_heads, groups, rows, dim)
    k_context, v_context = key[:, :, None, :width], value[:, :, None, :width]  # [B, H_kv, 1, T, D]
    context = (q @ k_context.transpose(-1, -2)) * scaling  # [B, H_kv, G, R, T]
    context = context.masked_fill(~attention_mask.context[:, None, None], float("-inf"))
    q_own = q.view(batch, kv_heads, groups, blocks, size, dim)
    k_own = key[:, :, None, width:].view(batch, kv_heads, 1, blocks, size, dim)
    v_own = value[:, :, None, width:].view(batch, kv_heads, 1, blocks, size, dim)
    own = (q_own @ k_own.transpose(-1, -2)) * scaling  # [B, H_kv, G, N, S, S]
    top = torch.maximum(context.amax(-1), own.amax(-1).flatten(-2))  # [B, H_kv, G, R]: a row sees its own block
    p_context = (context - top[..., None]).exp()
    p_own = (own - top.view_as(own[..., 0])[..., None]).exp()
    total = p_context.sum(-1) + p_own.sum(-1).flatten(-2)  # [B, H_kv, G, R]
    out = p_context.to(value.dtype) @ v_context + (p_own.to(value.dtype) @ v_own).flatten(-3, -2)  # [B, H_kv, G, R, D]
    out = out / total[..., None].to(out.dtype)
    return out.view(batch, heads, rows, dim).transpose(1, 2), None


AttentionInterface.register(ATTENTION, block_attention)  # the name the layers' config names


class _PrefixedLayer(CacheLayerMixin):
    """One layer's context keys and values [B, H_kv, S, D] in transformers' cache-layer interface: `update` returns them
    followed by the block's new ones and keeps nothing (the block's entries are scratch)."""

    is_sliding = False
    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2] + query_length, 0

    def get_max_length(self) -> int:
        return -1


class PrefixedCache(Cache):
    """Every layer's context keys and values (`context[l] = (keys, values)`), followed by the block's at attention."""

    def __init__(self, context: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(layers=[_PrefixedLayer(k, v) for k, v in context])
