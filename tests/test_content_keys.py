"""Stores keyed by content: a target's weight file rewritten in place by another checkpoint of the same size, its
modification time set back (`cp -p`, `rsync -a`, a restore from a backup), gets the new weights' fingerprint, and
every store keyed by the fingerprint misses: the compile cache, the training target cache and the cost models."""

import json
import os
import shutil

import pytest

from medusa_like.decoding.cost_model import CostModel
from medusa_like.forward import cost_cache, prepare_target
from medusa_like.forward.compile_cache import cache_directory
from medusa_like.forward.compiled import CompiledStep
from medusa_like.io import user_cache_dir
from medusa_like.targets import load_target, weights_fingerprint
from medusa_like.tiny import tiny_chat_target
from medusa_like.training.target_cache import TargetCache, TargetCacheMismatchError, cache_key

from .test_target_cache import CONTENT, fake_outputs, synthetic_rows


def save_target(directory, seed: int):
    """The tiny llama of `seed` saved with its tokenizer as a model directory (what `load_target` reads by path)."""
    model, tokenizer = tiny_chat_target("llama", seed=seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory / "model.safetensors"


def stores(target, tmp_path) -> dict:
    """Where each store keyed by `target`'s weights keeps its entry: the compiled step's cache directory, the cost
    model's cache file and the training target cache's key."""
    prepared = prepare_target(target, backend="sdpa", tuned_layers=False)
    return {
        "compile cache": cache_directory(CompiledStep(target, {}, "test")),
        "cost model": cost_cache.cache_path(prepared),
        "target cache": cache_key(weights_fingerprint(target), target.dtype, CONTENT, 64),
    }


@pytest.mark.slow
def test_a_rewrite_of_the_same_size_and_time_gets_the_new_weights_fingerprint_and_every_store_misses(tmp_path):
    weights, other = save_target(tmp_path / "target", 0), save_target(tmp_path / "other", 1)
    assert weights.stat().st_size == other.stat().st_size  # one config: the same tensors' sizes, the same file size
    old, _ = load_target(str(weights.parent))
    before = weights_fingerprint(old)  # hashed, and cached on disk under the file's content
    old_stores = stores(old, tmp_path)
    prepared = prepare_target(old, backend="sdpa", tuned_layers=False)
    cost_cache.store(CostModel([1, 2], [10.0, 11.0], **prepared.identity()), prepared)
    assert cost_cache.cached(prepared) is not None
    TargetCache(tmp_path / "target_cache", old_stores["target cache"]).build(
        synthetic_rows(8), fake_outputs, batch_tokens=64, shard_tokens=100
    )

    status = weights.stat()
    shutil.copyfile(other, weights)  # another checkpoint in its place, its time set back as `cp -p` would
    os.utime(weights, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (status.st_size, status.st_mtime_ns)

    new, _ = load_target(str(weights.parent))
    now = weights_fingerprint(new)
    assert before == weights_fingerprint(tiny_chat_target("llama", seed=0)[0])  # each the weights' own hash
    assert now == weights_fingerprint(tiny_chat_target("llama", seed=1)[0]) != before
    cached = json.loads((user_cache_dir() / "fingerprints.json").read_text())
    assert {before, now} <= set(cached.values())  # one entry per content
    new_stores = stores(new, tmp_path)
    for store in ("compile cache", "cost model"):
        assert new_stores[store] != old_stores[store], store
    assert cost_cache.cached(prepare_target(new, backend="sdpa", tuned_layers=False)) is None
    with pytest.raises(TargetCacheMismatchError, match=f"target_weights: cache '{before}', run '{now}'"):
        TargetCache(tmp_path / "target_cache", new_stores["target cache"])

    again, _ = load_target(str(weights.parent))  # the same bytes again: the fingerprint on disk
    assert weights_fingerprint(again) == now
