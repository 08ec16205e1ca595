"""A preallocated KV cache for tree verification, plugged into transformers through its `Cache` interface.

Each layer owns two buffers [B, H_kv, capacity, D]. The first `length` slots hold the committed sequence at positions
0..length-1. A forward writes its new keys/values right after them (`update`, called by the model's own attention
layers) and attends over the live prefix `[:length + T]` only, so attention cost follows the tokens in the cache, not
its capacity. After verification `commit(slots)` moves the accepted nodes' entries to contiguous slots with one
indexed copy per layer; rejected entries are left behind and overwritten by the next step, nothing is rolled back.

`BatchTreeKVCache` keeps the same contract for B sequences: buffers [B, H_kv, capacity, D], a committed length per row,
a forward's entries written at each row's own offset, each row's accepted nodes committed by one gather and one
scatter per layer for the whole batch (`commit_slots`), and finished rows dropped (`keep`).
"""

from contextlib import contextmanager

import torch
from torch.nn.utils.rnn import pad_sequence
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
        check_room(self.length, new_tokens, self.capacity)

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


# ---------------------------------------------------------------------------------------------------------------------
# A batch of sequences: one committed length per row


def write_slots(lengths: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The slots a forward of `new_tokens` per row writes [B, T]: right after each row's committed entries."""
    return lengths[:, None] + torch.arange(new_tokens, device=lengths.device)


def commit_slots(lengths: list[int], nodes: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination) slots [B, A] that move each row's accepted nodes (`nodes[b]`: indices into the row's
    last forward, ascending, root first) to the slots after its committed entries. Rows that keep fewer than A pad
    with slots copied onto themselves, so one gather and one scatter serve every row."""
    kept = pad_sequence([n.to(device) for n in nodes], batch_first=True, padding_value=-1)  # [B, A]
    offsets = torch.arange(kept.shape[1], device=device).expand_as(kept)  # [B, A]
    base = torch.tensor(lengths, device=device)[:, None]  # [B, 1]
    return base + torch.where(kept >= 0, kept, offsets), base + offsets


def check_room(length: int, new_tokens: int, capacity: int) -> None:
    """Refuse a forward of `new_tokens` after `length` committed tokens that would overflow a cache of `capacity`."""
    if length + new_tokens > capacity:
        raise CacheOverflowError(
            f"KV cache too small: {length} tokens committed + {new_tokens} new > capacity {capacity}; "
            "raise max_cache_len (or shorten the prompt / max_new_tokens)"
        )


def check_rows_room(lengths: list[int], new_tokens: int, capacity: int) -> None:
    """Refuse a forward of `new_tokens` per row after rows of `lengths` committed tokens that would overflow one."""
    longest = max(lengths)
    if longest + new_tokens > capacity:
        raise CacheOverflowError(
            f"KV cache too small: a row of {longest} tokens committed + {new_tokens} new > capacity {capacity}; "
            "raise max_cache_len (or shorten the prompts / max_new_tokens)"
        )


class BatchCacheLayer(CacheLayerMixin):
    """One decoder layer of a `BatchTreeKVCache`: buffers [B, H_kv, capacity, D], row b's committed entries in slots
    0..lengths[b]-1. A forward over the first R rows writes their T new entries at each row's own offset and attends
    over the slots 0..max(lengths) + T - 1 of those rows: the loop's [R, 1, T, S] mask says which each token sees."""

    is_sliding = False  # the window is applied by the attention backend, by position
    is_compileable = False

    def __init__(self, owner: "BatchTreeKVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, capacity = self.owner.rows, self.owner.capacity
        heads, k_dim = key_states.shape[1], key_states.shape[-1]
        self.keys = key_states.new_zeros(rows, heads, capacity, k_dim)
        self.values = value_states.new_zeros(rows, heads, capacity, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write T new entries per row [R, H_kv, T, D] after each row's committed ones; return the R rows' live
        keys/values [R, H_kv, S, D], S = the longest row's committed entries + T."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.owner.packed is not None:  # a packed forward's N nodes [1, H_kv, N, D], each at its (row, slot)
            index, slots, rows, live = self.owner.packed  # [N], [N], R, S
            self.keys[index, :, slots] = key_states[0].transpose(0, 1)  # [N, H_kv, D]
            self.values[index, :, slots] = value_states[0].transpose(0, 1)
            return self.keys[:rows, :, :live], self.values[:rows, :, :live]
        rows, new = key_states.shape[0], key_states.shape[2]
        slots, live = self.owner.slots(rows, new, key_states.device)  # [R, T], S
        index = torch.arange(rows, device=slots.device)[:, None]  # [R, 1]
        self.keys[index, :, slots] = key_states.transpose(1, 2)  # [R, T, H_kv, D] at (row, slot)
        self.values[index, :, slots] = value_states.transpose(1, 2)
        return self.keys[:rows, :, :live], self.values[:rows, :, :live]

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy each row's entries at `source` [R, A] to `dest` [R, A] (gathered first, so overlaps are safe)."""
        if self.is_initialized:
            index = torch.arange(source.shape[0], device=source.device)[:, None]
            self.keys[index, :, dest] = self.keys[index, :, source]
            self.values[index, :, dest] = self.values[index, :, source]

    def keep(self, rows: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[rows], self.values[rows]

    def extend(self, other: "BatchCacheLayer") -> None:
        """Append `other`'s rows (a layer of the same capacity) after this layer's (a layer never written holds
        nothing yet: its buffers are made at its first write, for every row)."""
        if not (self.is_initialized and other.is_initialized):
            if other.is_initialized or self.is_initialized:
                raise ValueError("cannot join a batch cache layer that was written to one that was not")
            return
        self.keys, self.values = torch.cat([self.keys, other.keys]), torch.cat([self.values, other.values])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(self.owner.lengths) + query_length, 0

    def get_seq_length(self) -> int:
        return max(self.owner.lengths)

    def get_max_length(self) -> int:
        return self.owner.capacity

    def reset(self) -> None:
        self.owner.lengths = [0] * self.owner.rows


class BatchTreeKVCache(Cache):
    """`TreeKVCache`'s contract for B sequences at once: per-row committed lengths, a forward's entries written at
    each row's own offset, per-row commits of the accepted nodes (one gather and one scatter per layer for the whole
    batch), `keep` to drop finished rows and `extend` to append joining ones. A forward over R rows covers the
    cache's first R rows (a chunked prefill orders rows by prompt length, longest first, so the rows still reading
    their prompt are a prefix)."""

    def __init__(self, num_layers: int, rows: int, capacity: int):
        if capacity < 1 or rows < 1:
            raise ValueError(f"a batch cache needs rows and capacity >= 1, got {rows} rows of capacity {capacity}")
        super().__init__(layers=[BatchCacheLayer(self) for _ in range(num_layers)])
        self.rows, self.capacity = rows, capacity
        self.lengths = [0] * rows  # committed tokens per row
        self._slots: dict = {}  # (rows, new tokens) -> (write slots [R, T], live length): until the next commit
        self.packed = None  # during a packed forward (`pack`): its nodes' rows and slots [N], its rows R, its S

    @classmethod
    def for_model(cls, model, rows: int, capacity: int) -> "BatchTreeKVCache":
        return cls(model.config.get_text_config().num_hidden_layers, rows, capacity)

    def slots(self, rows: int, new_tokens: int, device) -> tuple[torch.Tensor, int]:
        """Where a forward of `new_tokens` per row over the first `rows` rows writes [R, T], and its live length S."""
        key = (rows, new_tokens)
        if key not in self._slots:
            lengths = torch.tensor(self.lengths[:rows], device=device)
            self._slots[key] = write_slots(lengths, new_tokens), max(self.lengths[:rows]) + new_tokens
        return self._slots[key]

    @contextmanager
    def pack(self, rows: torch.Tensor, columns: torch.Tensor, width: int, count: int):
        """For the block, a forward over the first `count` rows has its new entries packed [1, H_kv, N, D]: entry n
        is node `columns[n]` of row `rows[n]`, written where that node sits in a padded forward of `width` nodes a
        row (slot lengths[row] + column), so `commit` keeps what it keeps after either."""
        lengths = torch.tensor(self.lengths[:count], device=rows.device)
        self.packed = rows, lengths[rows] + columns, count, max(self.lengths[:count]) + width
        try:
            yield
        finally:
            self.packed = None

    def check_room(self, new_tokens: int, rows: int | None = None) -> None:
        """Refuse, before anything is written, a forward of `new_tokens` per row that would not fit every row."""
        check_rows_room(self.lengths[:rows], new_tokens, self.capacity)

    def commit(self, nodes: list[torch.Tensor]) -> None:
        """Keep, for each of the first len(nodes) rows, the entries of its last forward at `nodes[b]` (indices into
        that forward, ascending, root first) as its next committed tokens."""
        source, dest = commit_slots(self.lengths[: len(nodes)], nodes, self._device())
        for layer in self.layers:
            layer.move(source, dest)
        self.commit_all([n.numel() for n in nodes])

    def commit_all(self, counts: list[int]) -> None:
        """Keep the first counts[b] entries of row b's last forward (a prefill chunk: already in their slots)."""
        for row, count in enumerate(counts):
            self.lengths[row] += count
        self._slots.clear()

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (indices of the cache's rows, in their new order): finished rows leave the batch."""
        index = torch.tensor(rows, device=self._device())
        for layer in self.layers:
            layer.keep(index)
        self.rows, self.lengths = len(rows), [self.lengths[r] for r in rows]
        self._slots.clear()

    def extend(self, other: "BatchTreeKVCache") -> "BatchTreeKVCache":
        """Append `other`'s rows (a cache of the same layers and capacity, its prompts read) after this cache's rows:
        prompts that join a running batch. Returns this cache."""
        if other.capacity != self.capacity or len(other.layers) != len(self.layers):
            raise ValueError(f"cannot join a cache of capacity {other.capacity} to one of {self.capacity}")
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.extend(theirs)
        self.rows, self.lengths = self.rows + other.rows, self.lengths + other.lengths
        self._slots.clear()
        return self

    def _device(self):
        return self.layers[0].device if self.layers[0].is_initialized else None
