"""The preallocated tree KV cache: live views, compaction of accepted paths, overflow refusal."""

import pytest
import torch

from medusa_like.decoding.kv_cache import CacheOverflowError, TreeKVCache


def kv(length: int, start: float = 0.0):
    """Keys/values [1, 2, length, 3] whose entries encode their own index, so moves are visible."""
    base = torch.arange(length, dtype=torch.float32) + start
    k = base.view(1, 1, length, 1).expand(1, 2, length, 3).clone()
    return k, -k


def test_update_returns_live_prefix_only():
    cache = TreeKVCache(num_layers=2, capacity=16)
    k, v = kv(5)
    keys, values = cache.update(k, v, layer_idx=0)
    assert keys.shape == (1, 2, 5, 3)  # not the capacity: attention follows the live tokens
    cache.update(k, v, layer_idx=1)
    cache.commit_all(5)
    assert cache.length == 5 and cache.get_seq_length() == 5
    k2, v2 = kv(4, start=100)
    keys, _ = cache.update(k2, v2, layer_idx=0)
    assert keys.shape[2] == 9
    assert torch.equal(keys[0, 0, :, 0], torch.tensor([0, 1, 2, 3, 4, 100, 101, 102, 103.0]))


def test_commit_moves_accepted_nodes_to_contiguous_slots():
    cache = TreeKVCache(num_layers=1, capacity=16)
    cache.update(*kv(3), layer_idx=0)
    cache.commit_all(3)
    cache.update(*kv(5, start=10), layer_idx=0)  # tree nodes 0..4 at slots 3..7
    cache.commit(torch.tensor([3, 5, 7]))  # accept nodes 0, 2, 4
    assert cache.length == 6
    layer = cache.layers[0]
    assert layer.keys[0, 0, :6, 0].tolist() == [0, 1, 2, 10, 12, 14]
    assert layer.values[0, 1, :6, 2].tolist() == [0, -1, -2, -10, -12, -14]
    # the next forward writes right after the committed entries, over the rejected ones
    keys, _ = cache.update(*kv(2, start=50), layer_idx=0)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 10, 12, 14, 50, 51]


def test_overflow_is_refused_before_anything_is_written():
    cache = TreeKVCache(num_layers=1, capacity=6)
    cache.update(*kv(4), layer_idx=0)
    cache.commit_all(4)
    before = cache.layers[0].keys.clone()
    with pytest.raises(CacheOverflowError, match="capacity 6"):
        cache.check_room(3)
    with pytest.raises(CacheOverflowError, match="holds 6 tokens"):
        cache.update(*kv(3, start=9), layer_idx=0)
    assert torch.equal(cache.layers[0].keys, before)
    assert cache.length == 4


def test_invalid_capacity():
    with pytest.raises(ValueError, match="capacity must be positive"):
        TreeKVCache(num_layers=1, capacity=0)
