"""The compiled step's caches: one preallocated buffer the graph reads and the step writes after it.

    cache = StaticTreeCache(layers, heads_kv, head_dim, capacity, dtype, device)   # [L, 2, 1, H_kv, S, D]
    cache = StaticBatchCache(layers, heads_kv, head_dim, rows, capacity, dtype, device)   # [L, 2, bucket(B), H_kv, S, D]
    view = LiveCache(buffer[..., :live, :], slots)   # transformers' Cache over the live part, inside the graph

`StaticTreeCache` and `StaticBatchCache` have the loop's cache interfaces (`decoding/kv_cache.py`'s `TreeKVCache` and
`BatchTreeKVCache`); `LiveCache` is what the traced target's layers see through transformers' Cache interface.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from medusa_like.decoding.kv_cache import check_room, check_rows_room, commit_slots

MIN_ROWS = 2  # a dimension of 1 is specialised by the compiler: single nodes are padded to two rows
# the batch sizes a batched step is compiled for (one graph each, on first use); a batch between two runs in the next
# with padded rows, one beyond the largest eagerly
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _LiveLayer(CacheLayerMixin):
    """One decoder layer's live entries in transformers' cache-layer interface: `update` attends over them with the
    step's new entries in their slots, and keeps the new ones for the step to write after the graph
    (`LiveCache.new`). Nothing is written inside the graph: the compiler turns an in-place write into a view of the
    graph's input into a copy of the whole buffer, every layer."""

    is_sliding = False  # the window is applied by the mask (`window_mask`), not by dropping entries
    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, owner: "LiveCache"):
        super().__init__()
        self.keys, self.values, self.owner = keys, values, owner  # [1, H_kv, S, D]
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        """Keep the T new entries [B, H_kv, T, D]; return the live keys and values with them in their slots
        [B, H_kv, S, D] (a copy: the committed part of a size the compiler need not name apart). `slots` is [T] for
        one sequence, [B, T] for a batch (each row's own)."""
        self.owner.new.append(torch.stack([key_states, value_states]))  # [2, B, H_kv, T, D]
        slots = self.owner.slots
        if slots.dim() == 1:
            return self.keys.index_copy(2, slots, key_states), self.values.index_copy(2, slots, value_states)
        index = slots[:, None, :, None].expand_as(key_states)  # [B, H_kv, T, D]
        return self.keys.scatter(2, index, key_states), self.values.scatter(2, index, value_states)

    def get_seq_length(self) -> int:
        return self.keys.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class LiveCache(Cache):
    """transformers' view of `live` [L, 2, B, H_kv, S, D] (the live part of the step's buffer), the step's entries
    at `slots` ([T], or [B, T] per row); `new` collects each layer's new entries."""

    def __init__(self, live: torch.Tensor, slots: torch.Tensor):
        self.slots, self.new = slots, []
        super().__init__(layers=[_LiveLayer(live[i, 0], live[i, 1], self) for i in range(live.shape[0])])


class StaticTreeCache:
    """The loop's cache (`kv_cache.TreeKVCache`'s interface) over one preallocated buffer: the committed entries
    sit in slots 0..length-1 at positions 0..length-1, a step's nodes right after them; `commit` moves the accepted
    nodes' entries into place with one indexed copy for every layer at once."""

    def __init__(self, num_layers: int, heads: int, head_dim: int, capacity: int, dtype, device):
        if capacity < 1:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        self.capacity = capacity
        # MIN_ROWS - 1 spare slots: a padded step writes its dummy row after the real ones
        self.buffer = torch.zeros(
            num_layers, 2, 1, heads, capacity + MIN_ROWS - 1, head_dim, dtype=dtype, device=device
        )
        self.length = 0

    def check_room(self, new_tokens: int) -> None:
        check_room(self.length, new_tokens, self.capacity)

    def commit(self, slots: torch.Tensor) -> None:
        """Keep the entries at `slots` (absolute, ascending, >= length) as the next committed tokens."""
        n = slots.numel()
        if n:
            dest = torch.arange(self.length, self.length + n, device=slots.device)
            self.buffer.index_copy_(4, dest, self.buffer.index_select(4, slots))  # index_select copies: overlap safe
        self.length += n

    def write(self, new: torch.Tensor) -> None:
        """Write a step's new entries [L, 2, 1, H_kv, T, D] right after the committed ones."""
        self.buffer[:, :, :, :, self.length : self.length + new.shape[4]] = new

    def commit_all(self, num_tokens: int) -> None:
        self.length += num_tokens

    def rewind(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} committed tokens to {length}")
        self.length = length


def bucket(rows: int) -> int:
    """The batch size a step of `rows` rows runs at: the smallest of `BUCKETS` that holds them (padded rows after
    them), or `rows` itself beyond the largest (then the step runs eagerly)."""
    return next((size for size in BUCKETS if size >= rows), rows)


class StaticBatchCache:
    """The batched loop's cache (`kv_cache.BatchTreeKVCache`'s interface) over one buffer [L, 2, B, H_kv, capacity,
    D] for a bucket of B rows (`bucket`): the batch's `rows` rows first, each with its own committed length, padding
    rows after them. `keep` moves the kept rows to the front, into a smaller bucket's buffer where they fit one;
    `extend` appends joining rows, into a larger bucket's where they need one."""

    def __init__(self, num_layers: int, heads: int, head_dim: int, rows: int, capacity: int, dtype, device):
        if capacity < 1 or rows < 1:
            raise ValueError(f"a batch cache needs rows and capacity >= 1, got {rows} rows of capacity {capacity}")
        self.capacity, self.rows, self.lengths = capacity, rows, [0] * rows
        self.layout = (num_layers, 2, heads, head_dim, dtype, device)
        self.buffer = self._buffer(bucket(rows))

    def _buffer(self, size: int) -> torch.Tensor:
        layers, kv, heads, head_dim, dtype, device = self.layout
        # MIN_ROWS - 1 spare slots: a padded step writes its dummy rows after the real ones
        return torch.zeros(layers, kv, size, heads, self.capacity + MIN_ROWS - 1, head_dim, dtype=dtype, device=device)

    def check_room(self, new_tokens: int, rows: int | None = None) -> None:
        check_rows_room(self.lengths[:rows], new_tokens, self.capacity)

    def write(self, new: torch.Tensor, slots: torch.Tensor) -> None:
        """Write a step's new entries [L, 2, R, H_kv, T, D] of the first R rows at `slots` [R, T]."""
        index = torch.arange(slots.shape[0], device=slots.device)[:, None]  # [R, 1]
        self.buffer[:, :, index, :, slots] = new.permute(2, 4, 0, 1, 3, 5)  # [R, T, L, 2, H_kv, D]

    def commit(self, nodes: list[torch.Tensor]) -> None:
        """Keep each of the first len(nodes) rows' entries of its last forward at `nodes[b]` (ascending, root first)."""
        source, dest = commit_slots(self.lengths[: len(nodes)], nodes, self.buffer.device)  # [R, A]
        index = torch.arange(len(nodes), device=self.buffer.device)[:, None]
        self.buffer[:, :, index, :, dest] = self.buffer[:, :, index, :, source]  # gathered first: overlap safe
        self.commit_all([n.numel() for n in nodes])

    def commit_all(self, counts: list[int]) -> None:
        for row, count in enumerate(counts):
            self.lengths[row] += count

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (indices of the batch's rows, in their new order), at the front of the smallest bucket."""
        kept = self.buffer.index_select(2, torch.tensor(rows, device=self.buffer.device))
        size = bucket(len(rows))
        if size != self.buffer.shape[2]:
            self.buffer = self._buffer(size)
        self.buffer[:, :, : len(rows)] = kept
        self.rows, self.lengths = len(rows), [self.lengths[r] for r in rows]

    def extend(self, other: "StaticBatchCache") -> "StaticBatchCache":
        """Append `other`'s rows (a cache of the same layout and capacity) after this cache's, in the bucket that
        holds them all (`kv_cache.BatchTreeKVCache.extend`'s contract). Returns this cache."""
        if other.capacity != self.capacity or other.layout != self.layout:
            raise ValueError(f"cannot join a cache of capacity {other.capacity} to one of {self.capacity}")
        rows = self.rows + other.rows
        if bucket(rows) != self.buffer.shape[2]:
            grown = self._buffer(bucket(rows))
            grown[:, :, : self.rows] = self.buffer[:, :, : self.rows]
            self.buffer = grown
        self.buffer[:, :, self.rows : rows] = other.buffer[:, :, : other.rows]
        self.rows, self.lengths = rows, self.lengths + other.lengths
        return self
