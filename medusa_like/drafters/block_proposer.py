"""The block drafter's side of the decoding protocol: its cache of the committed context, one drafting step as a pure
function of tensors (what compiles), and the proposer that drafts a tree from one block forward a step.

    proposer = drafter.proposer(target)        # a `BlockProposer` (drafters/protocol.py's interface)
    proposer.begin(prompt_ids, features, root, capacity)
    tree = proposer.propose(spec)              # one block forward, a tree grown from its positions' top-k
    proposer.accept(tokens, features, bonus)   # the accepted nodes' features are committed before the next block

The drafter's weights, its layers and its forward are `block.py`'s.
"""

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..decoding.draft_tree import DraftTree
from ..decoding.kv_cache import CacheOverflowError
from ..decoding.tree import TreeSpec

if TYPE_CHECKING:
    from .block import BlockDrafter

# the block graph's compiled shapes: new context rows MIN_ROWS .. MAX_ROWS (a dimension of 1 would be specialised, so
# fewer are padded; more, the prompt's, run the graph eagerly) after at least MIN_ROWS committed entries
MIN_ROWS, MAX_ROWS, MAX_CONTEXT = 2, 64, 1 << 20


class ContextCache:
    """The block drafter's cache of the committed context: one buffer [L, 2, H_kv, capacity, D] whose first `length`
    slots hold every layer's keys and values of the committed tokens at positions 0 .. length - 1."""

    def __init__(self, drafter: "BlockDrafter", capacity: int, device):
        attn = drafter.layers[0].self_attn
        heads = drafter.config.layer["num_key_value_heads"]
        dtype = drafter.fc.weight.dtype
        self.capacity, self.length = capacity, 0
        self.buffer = torch.zeros(
            drafter.config.num_layers, 2, heads, capacity, attn.head_dim, dtype=dtype, device=device
        )

    def check_room(self, new: int) -> None:
        if self.length + new > self.capacity:
            raise CacheOverflowError(
                f"the block drafter's context cache holds {self.capacity} tokens: {self.length} committed + {new} new "
                "was refused"
            )

    def append(self, entries: torch.Tensor) -> None:
        """Commit new context entries [L, 2, H_kv, n, D] after the committed ones."""
        n = entries.shape[3]
        self.check_room(n)
        self.buffer[:, :, :, self.length : self.length + n] = entries
        self.length += n


class BlockGraph(nn.Module):
    """One drafting step as a pure function of tensors (what `compile_drafting` compiles, and what runs eagerly
    otherwise): the new context rows' keys and values, then the block's forward over every context entry and its own
    rows. A module holding the drafter, so that compiling freezes its weights as constants."""

    def __init__(self, drafter: "BlockDrafter"):
        super().__init__()
        self.drafter = drafter

    def forward(self, features, root, context_positions, block_positions, real, seen, buffer):
        """features [c, F] (the new context rows' target features, `real` [c] saying which are not padding) at
        context_positions [c]; root [1, h] (the root's embedding) and block_positions [B]; seen [S] (the S committed
        entries of `buffer` [L, 2, H_kv, capacity, D], all visible) -> (logits [B - 1, N] of the drafted positions,
        fp32; the predecessor head's projection of their states [B - 1, r], r = 0 without one; the new rows' entries
        [L, 2, H_kv, c, D], for the caller to commit)."""
        drafter = self.drafter
        new = drafter.context_keys(drafter.context(features)[None], context_positions[None])  # L x ([1, H_kv, c, D],)
        live = buffer[:, :, None, :, : seen.shape[0]]  # [L, 2, 1, H_kv, S, D]
        keys = [(torch.cat([live[i, 0], k], 2), torch.cat([live[i, 1], v], 2)) for i, (k, v) in enumerate(new)]
        block = drafter.block_embeddings(root)  # [1, B, h]
        size = block.shape[1]
        visible = torch.cat([seen, real, torch.ones(size, dtype=torch.bool, device=real.device)])  # [S + c + B]
        state = drafter(block, block_positions[None], keys, visible.expand(size, -1)[None, None])[0, 1:]  # [B - 1, h]
        entries = torch.stack([torch.stack([k[0], v[0]]) for k, v in new])  # [L, 2, H_kv, c, D]
        projected = drafter.predecessor_projection(state) if drafter.predecessor is not None else state[:, :0]
        return drafter.lm_head(state).float(), projected.float(), entries

    def example_inputs(self) -> tuple:
        """Inputs of the graph's shapes to trace it with: 3 new context rows after 5 committed in a buffer of 11."""
        drafter = self.drafter
        weight = drafter.fc.weight
        config, rows, committed, capacity = drafter.config, 3, 5, 11
        features = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        root = torch.zeros(1, config.hidden_size, dtype=weight.dtype, device=weight.device)
        context_positions = torch.arange(committed, committed + rows, device=weight.device)
        block_positions = torch.arange(committed + rows, committed + rows + config.block_size, device=weight.device)
        real = torch.ones(rows, dtype=torch.bool, device=weight.device)
        seen = torch.ones(committed, dtype=torch.bool, device=weight.device)
        buffer = ContextCache(drafter, capacity, weight.device).buffer
        return features, root, context_positions, block_positions, real, seen, buffer


class BlockProposer:
    """Drafts trees from one block forward a step (see `drafters/protocol.py`). The context cache holds the target's
    features of every committed token (the prompt's, then each step's accepted nodes'); the root, the target's next
    token, sits at the position after them. A step runs the compiled block graph where the drafter has one and the
    shapes fit it (at least MIN_ROWS committed entries, at most MAX_ROWS new rows: padded to MIN_ROWS), else the same
    graph eagerly (the first step, which commits the prompt)."""

    def __init__(self, drafter: "BlockDrafter", target):
        self.drafter, self.eager, self.compiled = drafter, BlockGraph(drafter), drafter.block_step()
        self.embed = target.get_input_embeddings()
        drafter.use_target_embeddings(self.embed)
        self.feature_layers = drafter.config.feature_layers
        self.max_depth = drafter.max_depth
        self.max_rank = drafter.config.draft_vocab_size

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor, root: torch.Tensor, capacity: int) -> None:
        self.cache = ContextCache(self.drafter, capacity, root.device)
        self.pending, self.root = features, root  # [a, F]: features not yet in the cache

    def accept(self, tokens: torch.Tensor, features: torch.Tensor, bonus: torch.Tensor) -> None:
        self.pending = torch.cat([self.pending, features])  # appended: a combined proposer may skip a step
        self.root = bonus

    @torch.inference_mode()
    def propose(self, spec: TreeSpec) -> DraftTree:
        if spec.max_depth == 0:
            return spec.grow(self.root, None)
        unary, projected = self.block_logits(spec.max_depth)  # [D, N], [D, r]
        drafter, k = self.drafter, min(spec.top_k, unary.shape[-1])
        if drafter.predecessor is None:  # position `depth`'s candidates, after every node of the depth alike
            top = unary.log_softmax(-1).topk(k, dim=-1)  # [D, k]
            tokens = drafter.token_ids[top.indices]

            def expand(frontier, _tokens, _parents, depth):
                count = frontier.numel()
                return tokens[depth - 1].expand(count, -1), top.values[depth - 1].expand(count, -1)

        else:  # each frontier node's own candidates: the position's logits rescored by the node's token

            def expand(frontier, tokens, _parents, depth):
                previous = tokens[frontier]  # [F]: the tokens the children follow (the root's at depth 1)
                logits = unary[depth - 1] + drafter.rescoring(projected[depth - 1], previous).float()  # [F, N]
                top = logits.log_softmax(-1).topk(k, dim=-1)
                return drafter.token_ids[top.indices], top.values

        return spec.grow(self.root, expand)

    @torch.inference_mode()
    def block_log_probs(self, depth: int, previous: torch.Tensor | None = None) -> torch.Tensor:
        """log-probabilities [depth, N] of the positions root + 1 .. root + depth from one block (`block_logits`); with
        the predecessor head, rescored by `previous` [depth], the tokens before those positions."""
        unary, projected = self.block_logits(depth)
        if self.drafter.predecessor is not None:
            unary = unary + self.drafter.rescoring(projected, previous).float()
        return unary.log_softmax(-1)

    @torch.inference_mode()
    def block_logits(self, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit the pending context, then draft one block after the root: the logits [depth, N] of the positions
        root + 1 .. root + depth, and the predecessor head's projection of their states [depth, r]."""
        cache, device, count = self.cache, self.root.device, self.pending.shape[0]
        cache.check_room(count)
        compiled = self.compiled is not None and cache.length >= MIN_ROWS and count <= MAX_ROWS
        rows = max(count, MIN_ROWS) if compiled else count
        # in the drafter's dtype: the compiled graph was traced with its inputs so (a bf16 drafter beside an fp32
        # target takes its features cast), and runs on that dtype's kernels only
        pending = self.pending.to(self.drafter.fc.weight.dtype)
        features = torch.cat([pending, pending.new_zeros(rows - count, pending.shape[1])])  # [rows, F]
        real = torch.arange(rows, device=device) < count
        committed = cache.length
        context_positions = torch.arange(committed, committed + rows, device=device)
        size = self.drafter.config.block_size
        block_positions = torch.arange(committed + count, committed + count + size, device=device)
        seen = torch.ones(committed, dtype=torch.bool, device=device)
        root = self.embed(self.root.view(1)).to(features.dtype)  # [1, h]
        step = self.compiled if compiled else self.eager
        logits, projected, entries = step(features, root, context_positions, block_positions, real, seen, cache.buffer)
        cache.append(entries[:, :, :, :count])
        self.pending = self.pending[:0]
        return logits[:depth], projected[:depth]
