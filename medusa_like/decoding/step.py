"""The target's forward as the decoding loop calls it: one interface, whatever computes it.

    step = EagerStep(target, "sdpa")                # the target's own forward (transformers), eagerly
    cache = step.new_cache(capacity)                # room for `capacity` committed tokens (and a tree after them)
    logits, features = step.forward(input_ids, position_ids, tree_mask, cache, feature_layers)   # [T, V], [T, F]
    cache.commit(slots)                             # keep the accepted nodes' entries (see `kv_cache.py`)

`input_ids` [1, T] are new tokens after the `cache.length` committed ones, at `position_ids` [1, T]; `tree_mask` is
None for a causal block (a prompt's prefill) or a [1, 1, T, T] boolean mask (which new token sees which); `last=True`
(a prefill) asks for the last token's logits only. Every call goes through the target's public forward, with masks,
positions and the cache passed in, so any family transformers loads works.

A batch of rows (`batch.py`) goes through the same step, its own cache and one forward per step for every row:

    cache = step.new_batch_cache(rows, capacity)     # per-row committed lengths (`kv_cache.BatchTreeKVCache`)
    logits, features = step.forward_batch(input_ids, position_ids, mask, cache, feature_layers)  # [B, T, V], [B, T, F]
    cache.commit(nodes)                             # each row's accepted nodes

`input_ids`, `position_ids` [B, T] cover the cache's first B rows; `mask` [B, 1, T, S] is the whole visibility over
the live slots (`batch_inputs.py`); `last` [B] (a prefill chunk) asks for the logits of one node per row only;
`nodes` (a tree step) says how many of each row's T nodes are real, the rest padding. A step that `packs` computes
only the real ones: the eager step runs its forward over the N real nodes side by side, [1, N], and only attention
places them back in their rows (`attention.packed_rows`), so a step's products cost N rows, not B x T, and a row's
extra node costs one row of the forward rather than one for every row of the batch (`cost_model.BatchShare`).

`EagerStep` is the reference: what the loop runs unless the caller hands it another step. Where a target runs faster
on this machine (CPU kernels, a compiled step) is `medusa_like.forward`'s business: it builds its own steps behind
this interface, and the loop never asks which one it was given.
"""

import torch
from transformers import PreTrainedModel

from medusa_like.targets import cache_keyword, output_logits

from .attention import packed_rows, tree_attention
from .kv_cache import BatchTreeKVCache, TreeKVCache


class TargetStep:
    """What the loop needs of a target's forward. Subclasses keep the contract of `EagerStep`."""

    target: PreTrainedModel
    packs = False  # whether `forward_batch` computes only the real nodes of a padded tree step (`nodes`)

    def new_cache(self, capacity: int):
        """A KV cache for one sequence (`kv_cache.TreeKVCache`'s interface) with room for `capacity` tokens."""
        raise NotImplementedError

    def forward(self, input_ids, position_ids, tree_mask, cache, feature_layers=None, last: bool = False):
        """New tokens [1, T] through the target, their KV written into `cache` after its committed entries. Returns
        (logits [T, V], or [1, V] for the last token when `last`; drafter features [T, F]: the concatenated
        `hidden_states[i]` for i in `feature_layers`, or the last hidden state when None)."""
        raise NotImplementedError

    def new_batch_cache(self, rows: int, capacity: int):
        """A KV cache for `rows` sequences (`kv_cache.BatchTreeKVCache`'s interface), `capacity` tokens each."""
        raise NotImplementedError

    def forward_batch(self, input_ids, position_ids, mask, cache, feature_layers=None, last=None, nodes=None):
        """New tokens [B, T] of the cache's first B rows through the target, each row's KV written after its own
        committed entries, under `mask` [B, 1, T, S]; `nodes` [B] (a list of ints, or None: all T), each row's real
        nodes, its first nodes[b]. Returns (logits [B, T, V], or [B, V] at the nodes `last` [B]; drafter features
        [B, T, F], as `forward`'s): what a padding node gets is unspecified."""
        raise NotImplementedError

    def describe(self) -> str:
        """What computes this forward, in a few words, for logs, reports and cost models."""
        raise NotImplementedError


class EagerStep(TargetStep):
    """The target's own forward, called eagerly with a `TreeKVCache` and a tree mask, its attention through
    `backend` (`attention.py`: eager, sdpa or flash)."""

    packs = True

    def __init__(self, target: PreTrainedModel, backend: str = "sdpa"):
        self.target, self.backend = target, backend

    def new_cache(self, capacity: int) -> TreeKVCache:
        return TreeKVCache.for_model(self.target, capacity)

    def new_batch_cache(self, rows: int, capacity: int) -> BatchTreeKVCache:
        return BatchTreeKVCache.for_model(self.target, rows, capacity)

    def forward(self, input_ids, position_ids, tree_mask, cache, feature_layers=None, last: bool = False):
        hidden, features = self._run(input_ids, position_ids, tree_mask, cache, feature_layers)
        hidden, features = hidden[0], features[0]  # [T, H], [T, F]
        return output_logits(self.target, hidden[-1:] if last else hidden), features  # [T or 1, V], [T, F]

    def forward_batch(self, input_ids, position_ids, mask, cache, feature_layers=None, last=None, nodes=None):
        if self.packs and nodes is not None and last is None and min(nodes) < input_ids.shape[1]:
            return self._packed(input_ids, position_ids, mask, cache, feature_layers, nodes)
        hidden, features = self._run(input_ids, position_ids, mask, cache, feature_layers)  # [B, T, H], [B, T, F]
        if last is not None:
            hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [B, H]
        return output_logits(self.target, hidden), features  # [B, T or -, V], [B, T, F]

    def _packed(self, input_ids, position_ids, mask, cache, feature_layers, nodes):
        """`forward_batch` over the real nodes alone, packed [1, N], their logits and features placed back in their
        rows [B, T, ...] (a padding node's left unset)."""
        rows, width = input_ids.shape
        counts = torch.tensor(nodes, device=input_ids.device)  # [B]
        real = torch.arange(width, device=input_ids.device)[None] < counts[:, None]  # [B, T]
        row, column = real.nonzero(as_tuple=True)  # [N] each: row by row, in node order
        with packed_rows(row, column, width), cache.pack(row, column, width, rows):
            hidden, features = self._run(input_ids[real][None], position_ids[real][None], mask, cache, feature_layers)
        logits = output_logits(self.target, hidden[0])  # [N, V]
        row_logits = logits.new_empty(rows, width, logits.shape[-1])  # [B, T, V]
        row_features = features.new_empty(rows, width, features.shape[-1])  # [B, T, F]
        row_logits[row, column], row_features[row, column] = logits, features[0]
        return row_logits, row_features

    def _run(self, input_ids, position_ids, mask, cache, feature_layers):
        """The target's public forward -> (the last hidden state [B, T, H], the features [B, T, F])."""
        model = self.target.base_model
        with tree_attention(self.target, self.backend):
            out = model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask,
                use_cache=True,
                **{cache_keyword(model): cache},
                output_hidden_states=feature_layers is not None,
            )
        hidden = out.last_hidden_state
        return hidden, hidden if feature_layers is None else torch.cat(
            [out.hidden_states[i] for i in feature_layers], -1
        )

    def describe(self) -> str:
        return "eager"
