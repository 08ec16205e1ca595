"""Attention backends against each other, and the flash split-and-merge against the flash-attn kernel contract."""

import pytest
import torch

from medusa_like.decoding.attention import (
    attention_with_lse,
    eager_tree_attention,
    flash_available,
    flash_tree_attention,
    merge_partial_attention,
    pick_backend,
    reference_flash_attn_with_kvcache,
    sdpa_tree_attention,
    visible_keys,
)
from medusa_like.decoding.tree import TokenTree
from medusa_like.decoding.tree_files import resolve_tree


def qkv(q_len: int, kv_len: int, heads: int = 4, kv_heads: int = 2, dim: int = 8, seed: int = 0, **kw):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, q_len, dim, generator=g, **kw)
    k = torch.randn(1, kv_heads, kv_len, dim, generator=g, **kw)
    v = torch.randn(1, kv_heads, kv_len, dim, generator=g, **kw)
    return q, k, v


def test_visible_keys_applies_tree_mask_and_window_by_position():
    tree = TokenTree.from_paths([[0], [1], [0, 0]])  # depths 0, 1, 1, 2
    visible = visible_keys(tree.attention_mask, q_len=4, kv_len=10, sliding_window=None)
    assert visible[:, :6].all()  # the committed prefix is visible to every node
    assert torch.equal(visible[:, 6:], tree.attention_mask)
    # window 3: node at position 6 + depth sees keys at positions > pos - 3
    windowed = visible_keys(tree.attention_mask, q_len=4, kv_len=10, sliding_window=3)
    assert windowed[0, :6].tolist() == [False, False, False, False, True, True]  # root at position 6
    assert windowed[3, :6].tolist() == [False] * 6  # node [0, 0] at position 8 sees 6, 7, 8 only: the tree
    assert windowed[3, 6:].tolist() == [True, True, False, True]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("tree_name", ["none", "chain", "small", "medusa"])
def test_backends_agree(tree_name, window):
    tree = resolve_tree(tree_name, 4)
    q_len = tree.num_nodes
    q, k, v = qkv(q_len, 20 + q_len)
    mask = tree.attention_mask[None, None]
    ref, _ = eager_tree_attention(None, q, k, v, mask, scaling=0.3, sliding_window=window)
    for fn in (sdpa_tree_attention, flash_tree_attention):
        out, _ = fn(None, q, k, v, mask, scaling=0.3, sliding_window=window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_causal_block_agrees(window):
    q, k, v = qkv(7, 7)
    ref, _ = eager_tree_attention(None, q, k, v, None, scaling=0.4, sliding_window=window)
    for fn in (sdpa_tree_attention, flash_tree_attention):
        out, _ = fn(None, q, k, v, None, scaling=0.4, sliding_window=window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_eager_matches_plain_softmax_attention():
    q, k, v = qkv(3, 9, heads=2, kv_heads=2)
    visible = visible_keys(None, 3, 9, None)
    out, lse = attention_with_lse(q, k, v, visible, scaling=0.5)
    scores = (q @ k.transpose(-1, -2)) * 0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, scores.logsumexp(-1))


def test_merge_of_two_halves_is_the_whole_softmax():
    q, k, v = qkv(5, 12)
    visible = torch.ones(5, 12, dtype=torch.bool)
    whole, whole_lse = attention_with_lse(q, k, v, visible, scaling=0.35)
    a, lse_a = attention_with_lse(q, k[:, :, :7], v[:, :, :7], visible[:, :7], scaling=0.35)
    b, lse_b = attention_with_lse(q, k[:, :, 7:], v[:, :, 7:], visible[:, 7:], scaling=0.35)
    merged, lse = merge_partial_attention(a, lse_a, b, lse_b)
    torch.testing.assert_close(merged, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse)


def test_merge_with_an_empty_half():
    q, k, v = qkv(2, 4)
    full, full_lse = attention_with_lse(q, k, v, torch.ones(2, 4, dtype=torch.bool), scaling=1.0)
    empty, empty_lse = attention_with_lse(q, k, v, torch.zeros(2, 4, dtype=torch.bool), scaling=1.0)
    assert torch.isneginf(empty_lse).all() and (empty == 0).all()
    merged, _ = merge_partial_attention(full, full_lse, empty, empty_lse)
    torch.testing.assert_close(merged, full)


def test_reference_kernel_contract():
    """cache_seqlens cuts the keys; causal and window are aligned to the end of the live keys."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 4, 8, generator=g)  # [B, Sq, H, D]
    k = torch.randn(1, 10, 2, 8, generator=g)  # [B, Sk, H_kv, D]
    v = torch.randn(1, 10, 2, 8, generator=g)
    out, lse = reference_flash_attn_with_kvcache(
        q, k, v, cache_seqlens=6, causal=True, window_size=(2, 0), return_softmax_lse=True
    )
    assert out.shape == (1, 3, 4, 8) and lse.shape == (1, 4, 3)
    # query i sits at key position 6 - 3 + i and sees keys [pos - 2, pos]
    for i, pos in enumerate([3, 4, 5]):
        keys = k[:, pos - 2 : pos + 1].repeat_interleave(2, dim=2)  # [1, 3, H, D]
        vals = v[:, pos - 2 : pos + 1].repeat_interleave(2, dim=2)
        scores = torch.einsum("bhd,bshd->bhs", q[:, i], keys) * 8**-0.5
        expected = torch.einsum("bhs,bshd->bhd", scores.softmax(-1), vals)
        torch.testing.assert_close(out[:, i], expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse[:, :, i], scores.logsumexp(-1))


def test_pick_backend():
    assert pick_backend("auto", torch.device("cpu")) == "sdpa"
    assert pick_backend("eager", torch.device("cpu")) == "eager"
    with pytest.raises(ValueError, match="unknown attention backend 'flashy'"):
        pick_backend("flashy", torch.device("cpu"))


def test_bad_mask_is_refused():
    q, k, v = qkv(2, 4)
    with pytest.raises(ValueError, match="bool mask"):
        sdpa_tree_attention(None, q, k, v, torch.zeros(1, 1, 2, 2), scaling=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not flash_available(), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("window", [None, 5])
def test_real_flash_kernel_matches_reference_and_split(window):
    from flash_attn import flash_attn_with_kvcache

    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(1, 7, 4, 64, **kw)
    k = torch.randn(1, 40, 2, 64, **kw)
    v = torch.randn(1, 40, 2, 64, **kw)
    real, real_lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=33, causal=False, return_softmax_lse=True)
    ref, ref_lse = reference_flash_attn_with_kvcache(q, k, v, cache_seqlens=33, return_softmax_lse=True)
    torch.testing.assert_close(real, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(real_lse, ref_lse, atol=2e-2, rtol=2e-2)

    tree = resolve_tree("small", 4).to("cuda")
    q, k, v = (torch.randn(1, h, n, 64, **kw) for h, n in ((4, 16), (2, 50), (2, 50)))
    mask = tree.attention_mask[None, None]
    out, _ = flash_tree_attention(None, q, k, v, mask, scaling=0.125, sliding_window=window)
    expected, _ = eager_tree_attention(None, q, k, v, mask, scaling=0.125, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not flash_available(), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("window", [None, 5])
def test_real_flash_kernel_causal_and_windowed_matches_reference(window):
    """The real kernel's causal (and sliding-window) contract, queries aligned to the end of the live keys, equals the
    plain-torch reference the CPU tests rely on; and the causal block of flash_tree_attention equals eager's."""
    from flash_attn import flash_attn_with_kvcache

    g = torch.Generator(device="cuda").manual_seed(2)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(1, 9, 4, 64, **kw)
    k = torch.randn(1, 48, 2, 64, **kw)
    v = torch.randn(1, 48, 2, 64, **kw)
    size = (window, 0) if window else (-1, -1)
    real, real_lse = flash_attn_with_kvcache(
        q, k, v, cache_seqlens=30, causal=True, window_size=size, return_softmax_lse=True
    )
    ref, ref_lse = reference_flash_attn_with_kvcache(
        q, k, v, cache_seqlens=30, causal=True, window_size=size, return_softmax_lse=True
    )
    torch.testing.assert_close(real, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(real_lse, ref_lse, atol=2e-2, rtol=2e-2)
    causal_only, _ = reference_flash_attn_with_kvcache(q, k, v, cache_seqlens=30, return_softmax_lse=True)
    assert (real - causal_only).abs().max() > 0.1  # the mask matters: a non-causal kernel would fail above

    q, k, v = (torch.randn(1, h, 12, 64, **kw) for h in (4, 2, 2))
    out, _ = flash_tree_attention(None, q, k, v, None, scaling=0.125, sliding_window=window)
    expected, _ = eager_tree_attention(None, q, k, v, None, scaling=0.125, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not flash_available(), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_real_flash_kernel_decodes_losslessly_on_sliding_window_targets(family):
    """End to end on the real kernel: tree verification through flash (static and dynamic trees, windows that slide)
    gives the target's own greedy output, or differs first at a near-tie. The kernel computes in bf16 (it takes no
    fp32), greedy through transformers' own attention: their rounding differs, so exact equality is not owed."""
    from medusa_like.decoding.tree import DynamicTreeSpec
    from medusa_like.model import MedusaLikeModel

    from .conftest import (
        assert_greedy_or_near_tie,
        random_heads,
        random_prompts,
        stock_greedy,
        tiny_target,
        untouched_target,
    )

    target = tiny_target(family).to("cuda", torch.bfloat16)
    model = MedusaLikeModel(target, None, random_heads(), backend="flash")
    assert model.backend == "flash"
    untouched = untouched_target(family, dtype=torch.bfloat16).to("cuda")
    for prompt in random_prompts(4, seed=4, min_len=10, max_len=30):
        prompt = prompt.cuda()
        expected = stock_greedy(untouched, [prompt], 20)[0]
        for tree in ("small", DynamicTreeSpec(4, 3, 10)):
            out = model.generate(prompt, max_new_tokens=20, tree=tree, eos_token_id=[])
            assert_greedy_or_near_tie(untouched, prompt, out.new_tokens.tolist(), expected)
