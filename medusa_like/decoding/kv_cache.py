"""A preallocated KV cache for tree verification, plugged into transformers through its `Cache` interface.

Each layer owns two buffers [B, H_kv, capacity, D]. The first `length` slots hold the committed sequence at positions
0..length-1. A forward writes its new keys/values right after them (`update`, called by the model's own attention
layers) and attends over the live prefix `[:length + T]` only, so attention cost follows the tokens in the cache, not
its capacity. After verification `commit(slots)` moves the accepted nodes' entries to contiguous slots with one
indexed copy per layer; rejected entries are left behind and overwritten by the next step, nothing is rolled back.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class CacheOverflowError(RuntimeError):
    pass


class TreeCacheLayer(CacheLayerMixin):
    is_sliding = False  # sliding layers keep their full history here; the window is applied by the attention backend
    is_compileable = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0  # committed tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, k_dim = key_states.shape
        self.keys = key_states.new_zeros(batch, heads, self.capacity, k_dim)
        self.values = value_states.new_zeros(batch, heads, self.capacity, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write T new entries after the committed ones and return the live keys/values [B, H_kv, length+T, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise CacheOverflowError(f"KV cache holds {self.capacity} tokens; writing {end} was refused")
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def commit(self, slots: torch.Tensor) -> None:
        """Keep the entries at `slots` (absolute, ascending, all >= length) as the next committed tokens."""
        n = slots.numel()
        if self.is_initialized and n:
            dest = slice(self.length, self.length + n)
            self.keys[:, :, dest] = self.keys.index_select(2, slots)  # index_select copies, so overlap is safe
            self.values[:, :, dest] = self.values.index_select(2, slots)
        self.length += n

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0


class TreeKVCache(Cache):
    """One `TreeCacheLayer` per decoder layer; pass as `past_key_values` to the target's forward."""

    def __init__(self, num_layers: int, capacity: int):
        if capacity < 1:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        super().__init__(layers=[TreeCacheLayer(capacity) for _ in range(num_layers)])
        self.capacity = capacity

    @classmethod
    def for_model(cls, model, capacity: int) -> "TreeKVCache":
        config = model.config.get_text_config()
        return cls(config.num_hidden_layers, capacity)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def check_room(self, new_tokens: int) -> None:
        """Refuse, before anything is written, a forward of `new_tokens` that would not fit."""
        if self.length + new_tokens > self.capacity:
            raise CacheOverflowError(
                f"KV cache too small: {self.length} tokens committed + {new_tokens} new > capacity {self.capacity}; "
                "raise max_cache_len (or shorten the prompt / max_new_tokens)"
            )

    def commit(self, slots: torch.Tensor) -> None:
        for layer in self.layers:
            layer.commit(slots)

    def commit_all(self, num_tokens: int) -> None:
        """Keep the whole last forward (prefill): its entries already sit in the right slots."""
        for layer in self.layers:
            layer.length += num_tokens

    def rewind(self, length: int) -> None:
        """Forget every entry from slot `length` on (a drafter's scratch tree entries); nothing is erased."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} committed tokens to {length}")
        for layer in self.layers:
            layer.length = length
