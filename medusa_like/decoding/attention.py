"""Tree attention backends, registered with transformers' `AttentionInterface` so the target's own layers call them.

Contract with `generate.py`: the target's forward gets `attention_mask=None` for a causal block (prefill, plain
decoding) or a [1, 1, T, T] boolean tree mask. In both cases the T new tokens are the last T of the live keys the
cache returns; the S - T keys before them are the committed prefix, visible to every new token. The loop passes each
node's position id (the prefix length plus its depth) to the model's forward, which applies the rotary embedding
before attention is called; the backends need only the mask. Sliding-window
layers (Mistral, Qwen2, Gemma) pass `sliding_window`, and the window is applied to tree tokens by position.

A batch (`batch.py`) passes instead the whole visibility, a [B, 1, T, S] boolean mask over the S live keys
(`batch_inputs.py`): each row's committed slots, then its nodes in the slots after them, where the rows' committed
lengths differ. Its last dimension is the keys' count, which tells it from a tree mask (the two agree where S = T).
The positions the window needs follow from it (`mask_positions`). A packed batch forward (`packed_rows`) computes
only the rows' real nodes, [1, N] of them side by side: a backend is handed their queries back in their rows,
[B, H, T, D], and its output is packed again, so the backends see one contract.

Backends:
    eager  dense float math, returns the log-sum-exp too; the reference for the others
    sdpa   torch's scaled_dot_product_attention with a dense boolean mask (CPU and GPU)
    flash  flash-attn's KV-cache kernel over the prefix (non-causal, with its log-sum-exp), dense math over the few
           tree tokens, and an exact merge of the two partial softmaxes. flash-attn takes no arbitrary mask, hence the
           split. Without CUDA the kernel is replaced by `reference_flash_attn_with_kvcache`, a plain-torch
           implementation of the same contract, so the split-and-merge is tested everywhere.

A backend that needs a machine's own kernel is added by the room that owns the kernel (`register_backend`: the
`rows` backend of `medusa_like.forward`, a row-invariant attention for bf16 CPU targets); this module never names one.
"""

import contextvars
import importlib.util
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface


def flash_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def pick_backend(backend: str, device: torch.device) -> str:
    """'auto' -> flash when usable on `device`, else sdpa. A forced backend is checked."""
    if backend == "auto":
        return "flash" if device.type == "cuda" and flash_available() else "sdpa"
    if backend not in _FUNCTIONS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {('auto', *_FUNCTIONS)}")
    return backend


# ---------------------------------------------------------------------------------------------------------------------
# Masks


def visible_keys(tree_mask: torch.Tensor | None, q_len: int, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """Which keys each new token may attend: [T, S] bool. `tree_mask` [T, T] or None for causal."""
    prefix = kv_len - q_len
    device = tree_mask.device if tree_mask is not None else None
    if tree_mask is None:
        block = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    else:
        block = tree_mask
    visible = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=block.device), block], dim=1)
    if sliding_window:
        q_pos = prefix + block.sum(-1) - 1  # [T]
        k_pos = torch.cat([torch.arange(prefix, device=block.device), q_pos])  # [S]
        visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    return visible


def mask_positions(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions a batch mask [B, 1, T, S] implies: (each node's [B, T], each slot's [B, S]). A node sees its
    row's committed slots, its ancestors and itself, so its position is that count - 1; node 0 (a real node in every
    row: a tree's root, a chunk's first token) sits at the row's committed length L; slot s holds position s below L,
    else node s - L's. A padding node sees only itself: its position is 0, and so is its slot's."""
    seen = mask[:, 0]  # [B, T, S]
    nodes, slots = seen.shape[1], torch.arange(seen.shape[2], device=mask.device)[None]  # T, [1, S]
    q_pos = seen.sum(-1) - 1  # [B, T]
    length = q_pos[:, :1]  # [B, 1]
    k_pos = torch.where(slots < length, slots, q_pos.gather(1, (slots - length).clamp(0, nodes - 1)))  # [B, S]
    return q_pos, k_pos


def batch_visible(mask: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """A batch mask [B, 1, T, S], within `sliding_window` positions of each node where one is given."""
    if not sliding_window:
        return mask
    q_pos, k_pos = mask_positions(mask)
    return mask & ((q_pos[:, :, None] - k_pos[:, None, :]) < sliding_window)[:, None]


def is_batch_mask(attention_mask: torch.Tensor | None, kv_len: int) -> bool:
    """Whether `attention_mask` is a batch's whole visibility [B, 1, T, S] (else a tree mask [1, 1, T, T], or None)."""
    return attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] == kv_len


def visible_to(attention_mask: torch.Tensor | None, q_len: int, kv_len: int, sliding_window: int | None):
    """Which keys each new token may attend, for either contract: [T, S] (a tree mask, or None for causal) or
    [B, 1, T, S] (a batch mask)."""
    if is_batch_mask(attention_mask, kv_len):
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"a batch's attention mask must be bool [B, 1, T, S], got {attention_mask.dtype}")
        return batch_visible(attention_mask, sliding_window)
    return visible_keys(tree_block(attention_mask), q_len, kv_len, sliding_window)


def tree_block(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The [T, T] tree mask a backend gets as `attention_mask` ([1, 1, T, T] bool), or None (a causal block)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.dtype != torch.bool or attention_mask.shape[0] != 1:
        raise ValueError(
            f"tree attention expects a [1, 1, T, T] bool mask or None, got {tuple(attention_mask.shape)} "
            f"{attention_mask.dtype}"
        )
    return attention_mask[0, 0]


# ---------------------------------------------------------------------------------------------------------------------
# Dense math


def attention_with_lse(q, k, v, visible, scaling: float, softcap: float | None = None):
    """Softmax attention returning (out [B, T, H, D], lse [B, H, T] fp32); fully masked rows give 0 and -inf.

    q [B, H, T, D], k/v [B, H_kv, S, D], visible [T, S] bool (or broadcastable to [B, H, T, S]).
    """
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling  # [B, H, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, T]
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])  # -inf rows -> all zeros
    out = torch.matmul(probs, v.float()).to(q.dtype)  # [B, H, T, D]
    return out.transpose(1, 2), lse


def merge_partial_attention(out_a, lse_a, out_b, lse_b):
    """Exact softmax over the union of two disjoint key sets, from each set's output [B, T, H, D] and lse [B, H, T]."""
    lse = torch.logaddexp(lse_a, lse_b)  # [B, H, T]
    safe = lse.nan_to_num(neginf=0.0)
    w_a = torch.exp(lse_a - safe).transpose(1, 2)[..., None]  # [B, T, H, 1]
    w_b = torch.exp(lse_b - safe).transpose(1, 2)[..., None]
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse


# ---------------------------------------------------------------------------------------------------------------------
# The flash-attn kernel contract


def reference_flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    return_softmax_lse=False,
):
    """Plain torch with the arguments and outputs of `flash_attn.flash_attn_with_kvcache` (no new k/v, no rotary).

    q [B, Sq, H, D]; k_cache/v_cache [B, Sk, H_kv, D]; cache_seqlens int or [B]: keys at or past it are ignored.
    Queries are aligned to the end of the live keys: query i sits at key position seqlen_k - Sq + i, which is what
    `causal` and `window_size=(left, right)` are relative to. Returns out [B, Sq, H, D] and, if asked, lse [B, H, Sq].
    """
    batch, q_len, _, head_dim = q.shape
    k_len = k_cache.shape[1]
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    if cache_seqlens is None:
        cache_seqlens = k_len
    seqlens = torch.as_tensor(cache_seqlens, device=q.device).reshape(-1).expand(batch)  # [B]
    q_pos = seqlens[:, None] - q_len + torch.arange(q_len, device=q.device)  # [B, Sq]
    k_idx = torch.arange(k_len, device=q.device)
    visible = k_idx[None, None, :] < seqlens[:, None, None]  # [B, Sq, Sk]
    left, right = window_size
    if causal:
        right = 0
    if left >= 0:
        visible = visible & (k_idx[None, None, :] >= q_pos[..., None] - left)
    if right >= 0:
        visible = visible & (k_idx[None, None, :] <= q_pos[..., None] + right)
    out, lse = attention_with_lse(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), visible[:, None], scale, softcap
    )
    return (out, lse) if return_softmax_lse else out


def flash_kernel(device: torch.device):
    """The real kernel on CUDA with flash-attn installed, else the reference implementation of its contract."""
    if device.type == "cuda" and flash_available():
        from flash_attn import flash_attn_with_kvcache

        return flash_attn_with_kvcache
    return reference_flash_attn_with_kvcache


# ---------------------------------------------------------------------------------------------------------------------
# Backends, in transformers' attention-function signature: (module, q, k, v, mask, ...) -> (out [B, T, H, D], None)


def eager_tree_attention(
    module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, **kwargs
):
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    visible = visible_to(attention_mask, query.shape[2], key.shape[2], sliding_window)  # [T, S] or [B, 1, T, S]
    out, _ = attention_with_lse(query, key, value, visible.to(query.device), scaling, softcap)
    return out, None


def sdpa_tree_attention(
    module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, **kwargs
):
    if softcap:  # sdpa has no logit soft-capping
        return eager_tree_attention(module, query, key, value, attention_mask, scaling, sliding_window, softcap)
    q_len, kv_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if attention_mask is None and not sliding_window and q_len == kv_len:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        visible = visible_to(attention_mask, q_len, kv_len, sliding_window).to(query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2), None


def flash_tree_attention(
    module, query, key, value, attention_mask, scaling=None, sliding_window=None, softcap=None, **kwargs
):
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    q_len, kv_len = query.shape[2], key.shape[2]
    if not is_batch_mask(attention_mask, kv_len):
        return _flash_row(query, key, value, tree_block(attention_mask), scaling, sliding_window, softcap), None
    # a batch: row by row, each over its own committed length L and its nodes' block, as if it were alone (a
    # padding node then sees the row's prefix too: its output is never read)
    lengths = (attention_mask[:, 0, 0].sum(-1) - 1).tolist()  # node 0 sees the L committed slots and itself
    rows = [
        _flash_row(
            query[b : b + 1],
            key[b : b + 1, :, : length + q_len],
            value[b : b + 1, :, : length + q_len],
            attention_mask[b, 0, :, length : length + q_len],
            scaling,
            sliding_window,
            softcap,
        )
        for b, length in enumerate(lengths)
    ]
    return torch.cat(rows), None


def _flash_row(query, key, value, block, scaling, sliding_window, softcap):
    """One row's flash attention: `block` [T, T] (a tree over the last T of the keys) or None (causal) ->
    [1, T, H, D]."""
    kernel = flash_kernel(query.device)
    q_len, kv_len = query.shape[2], key.shape[2]
    q = query.transpose(1, 2)  # [B, T, H, D]
    k_all, v_all = key.transpose(1, 2), value.transpose(1, 2)  # [B, S, H_kv, D]
    if block is None:  # causal block at the end of the cache: the kernel does it alone
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        out = kernel(
            q,
            k_all,
            v_all,
            cache_seqlens=kv_len,
            softmax_scale=scaling,
            causal=True,
            window_size=window,
            softcap=softcap or 0.0,
        )
        return out

    prefix = kv_len - q_len
    tree_visible = visible_keys(block, q_len, q_len, sliding_window)  # the tree among itself
    out, lse = attention_with_lse(query, key[:, :, prefix:], value[:, :, prefix:], tree_visible, scaling, softcap)
    if prefix == 0:
        return out

    depth = block.sum(-1) - 1  # [T]
    # prefix key j is visible to a node at depth d iff (prefix + d) - j < window, i.e. j >= first_visible(d)
    for d in depth.unique().tolist() if sliding_window else [None]:
        first = max(0, prefix + d - sliding_window + 1) if sliding_window else 0
        rows = (depth == d).nonzero().flatten() if sliding_window else slice(None)
        if first >= prefix:  # the window ends inside the tree: nothing of the prefix is visible
            continue
        out_p, lse_p = kernel(
            q[:, rows],
            k_all[:, first:prefix],
            v_all[:, first:prefix],
            cache_seqlens=prefix - first,
            softmax_scale=scaling,
            causal=False,
            softcap=softcap or 0.0,
            return_softmax_lse=True,
        )
        merged, _ = merge_partial_attention(out_p, lse_p, out[:, rows], lse[:, :, rows])
        out[:, rows] = merged
    return out


_FUNCTIONS = {}
# a packed batch forward's nodes (`packed_rows`): each packed node's row [N] and its column in that row [N], the rows'
# widest tree T; None: the queries are [B, H, T, D] as the backends take them
_PACKED: contextvars.ContextVar = contextvars.ContextVar("medusa_like_packed", default=None)


def register_backend(name: str, function) -> None:
    """Make `function` (transformers' attention-function signature, this module's mask contract) the backend `name`,
    for `pick_backend`, `tree_attention` and `EagerStep`."""
    _FUNCTIONS[name] = function
    AttentionInterface.register(f"medusa_like_{name}", _unpacking(function))


def _unpacking(function):
    """`function`, also for a packed forward's queries [1, H, N, D]: placed in their rows and columns [B, H, T, D]
    (padding queries zero: they see only their own slot, and their outputs are dropped), attended by `function`
    over the rows' keys [B, H_kv, S, D] and mask [B, 1, T, S], packed again -> [1, N, H, D]."""

    def attend(module, query, key, value, attention_mask, *args, **kwargs):
        packed = _PACKED.get()
        if packed is None:
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        rows, columns, width = packed
        placed = query.new_zeros(key.shape[0], query.shape[1], width, query.shape[3])  # [B, H, T, D]
        placed[rows, :, columns] = query[0].transpose(0, 1)  # [N, H, D] at (row, column)
        out, weights = function(module, placed, key, value, attention_mask, *args, **kwargs)  # [B, T, H, D]
        return out[rows, columns][None], weights  # [1, N, H, D]

    return attend


@contextmanager
def packed_rows(rows: torch.Tensor, columns: torch.Tensor, width: int):
    """For the block, the target's forward is a packed batch: its N new tokens are node `columns[n]` of row
    `rows[n]`, trees of up to `width` nodes (`kv_cache.BatchTreeKVCache.pack` writes their entries)."""
    token = _PACKED.set((rows, columns, width))
    try:
        yield
    finally:
        _PACKED.reset(token)


for _name, _fn in {"eager": eager_tree_attention, "sdpa": sdpa_tree_attention, "flash": flash_tree_attention}.items():
    register_backend(_name, _fn)


@contextmanager
def tree_attention(model, backend: str):
    """Route the target's attention through `backend` for the duration of the block; restore it afterwards."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = f"medusa_like_{backend}"
    try:
        yield
    finally:
        config._attn_implementation = previous
