"""The row-invariant attention kernel of the compiled CPU step (forward/cpu/tree_attention.py): SDPA's result to
rounding, the bits of a node's one-node step in any tree (fp32 and bf16, head sizes from 8 to 256, grouped heads, any
committed length), and clear errors for inputs it does not take."""

import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F

from medusa_like.benchmarks.attention import TREES, drifting_rows, tree_inputs
from medusa_like.forward.cpu import extension, tree_attention

pytestmark = pytest.mark.skipif(tree_attention.unavailable() is not None, reason=f"{tree_attention.unavailable()}")


def attend(query, key, value, visible, scale):
    return torch.ops.medusa_like.tree_attention(query, key, value, visible, scale)


@pytest.mark.parametrize("dim", [8, 64, 72, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_computes_sdpa_to_rounding(dim, dtype):
    query, key, value, visible, _ = tree_inputs(TREES["mixed, 12 nodes"], 37, heads=6, kv_heads=2, dim=dim, dtype=dtype)
    out = attend(query, key, value, visible, dim**-0.5)
    assert out.dtype == dtype and out.shape == query.shape and out.is_contiguous()
    expected = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=visible, scale=dim**-0.5, enable_gqa=True
    )
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("committed", [5, 64, 301])
@pytest.mark.parametrize("tree", list(TREES))
def test_a_tree_row_gets_the_bits_of_its_one_node_step(tree, committed, dtype):
    """Each node of a tree step against the same node computed as greedy decoding computes it: its ancestors
    committed in consecutive slots, then the node and a dummy row that sees only itself (the compiled step's padding;
    `drifting_rows`, whose own test shows it catches a row-count dependence). SDPA changes some of these rows
    (docs/cpu-kernels.md); the kernel changes none."""
    assert drifting_rows(attend, TREES[tree], committed, 9, 3, 64, dtype) == 0


def test_a_row_does_not_depend_on_the_thread_count():
    query, key, value, visible, _ = tree_inputs(TREES["mixed, 12 nodes"], 200, heads=9, kv_heads=3, dim=64,
                                              dtype=torch.bfloat16)  # fmt: skip
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(query, key, value, visible, 0.125)
        torch.set_num_threads(2)
        two = attend(query, key, value, visible, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_the_build_is_kept_under_its_key_in_the_user_cache():
    from medusa_like.io import user_cache_dir

    directory = tree_attention.KERNEL.directory()
    assert directory.parent == user_cache_dir() / "kernels" and directory.name.startswith("tree_attention-")
    assert len(list(directory.glob("*.so"))) == 1


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.touch()
    assert not extension.clear_stale_lock(tmp_path) and lock.exists()  # a build at work: waited for
    old = time.time() - extension.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING):
        assert extension.clear_stale_lock(tmp_path)
    assert not lock.exists() and "did not finish" in caplog.text
    assert not extension.clear_stale_lock(tmp_path)  # nothing left to remove


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, m: (q.half(), k.half(), v.half(), m), "float32 or bfloat16"),
        (lambda q, k, v, m: (q, k.bfloat16(), v, m), "share a dtype"),
        (lambda q, k, v, m: (q, k, v, m.float()), "bool mask"),
        (lambda q, k, v, m: (q, k, v, m[..., :-1]), r"visible must be \[1, 1, T, S\]"),
        (lambda q, k, v, m: (q[:, :5], k, v, m), "multiple of key heads"),
        (lambda q, k, v, m: (q.expand(2, -1, -1, -1), k, v, m), "batch 1"),
        (lambda q, k, v, m: (q, k, v[:, :, :-1], m), r"key and value must be \[1, H_kv, S, D\]"),
        (lambda q, k, v, m: (*(t.repeat(1, 1, 1, 4)[..., :200] for t in (q, k, v)), m), "head_dim 1..128 or 241..256"),
    ],
)  # fmt: skip
def test_inputs_it_does_not_take_are_refused_with_what_is_wrong(change, message):
    query, key, value, visible, _ = tree_inputs(TREES["chain of 4"], 10, heads=6, kv_heads=3, dim=64,
                                              dtype=torch.float32)  # fmt: skip
    with pytest.raises(RuntimeError, match=message):
        attend(*change(query, key, value, visible), 0.125)
