"""The EAGLE-3 drafter's side of the decoding protocol: a drafting level computed by the drafter's own modules, and
the proposer that drafts a tree level by level over the drafter's own KV cache.

    proposer = drafter.proposer(target)        # an `Eagle3Proposer` (drafters/protocol.py's interface)
    tree = proposer.propose(spec)              # one drafter forward per level, a tree grown by each node's top-k

The drafter's weights and its one-step forward are `eagle3.py`'s.
"""

from typing import TYPE_CHECKING

import torch

from ..decoding.draft_tree import DraftTree
from ..decoding.kv_cache import TreeKVCache
from ..decoding.tree import TreeSpec

if TYPE_CHECKING:
    from .eagle3 import Eagle3Drafter


class EagerLevel:
    """One drafting level as the drafter's own modules compute it, over its own `TreeKVCache`: rows of (feature, token
    embedding) at their positions -> their output states and draft-vocabulary logits. The T new entries are written
    after the cache's committed ones; the caller commits them. `forward/compiled_draft.py` computes the same, compiled.
    """

    def __init__(self, drafter: "Eagle3Drafter"):
        self.drafter = drafter

    def new_cache(self, capacity: int) -> TreeKVCache:
        return TreeKVCache(1, capacity)

    def __call__(self, feature, embeds, positions, visible, cache, last: bool = False):
        """feature, embeds [T, h], positions [T], visible [T, S] bool -> (states [T, h], logits [T, N] or, with
        `last`, the last row's [1, N])."""
        state = self.drafter(feature[None], embeds[None], positions[None], visible[None, None], cache)[0]
        return state, self.drafter.logits(state[-1:] if last else state)


class Eagle3Proposer:
    """Drafts trees with an `Eagle3Drafter` over its own KV cache (see `drafters/protocol.py`).

    Entry t of the drafter's cache holds (feature at t, token t + 1) at position t. Real entries (target features of
    committed tokens) are committed; a step's tree entries are written after them and dropped when the step ends. A
    tree node at depth d >= 1 is the entry (its parent's output state, its own token) at position n + d, where n is
    the last committed entry, and it attends to every committed entry, its ancestors' entries and itself.
    """

    max_depth = None  # drafts autoregressively: any depth

    def __init__(self, drafter: "Eagle3Drafter", target):
        self.drafter, self.level = drafter, drafter.level()
        self.embed = target.get_input_embeddings()
        self.feature_layers = drafter.config.aux_layer_ids
        self.max_rank = drafter.config.draft_vocab_size

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor, root: torch.Tensor, capacity: int) -> None:
        self.capacity, self.cache = capacity, None  # sized at the first proposal, when the tree's size is known
        self.pending_features = features  # [a, F]: target features not yet in the drafter's cache
        self.pending_tokens = torch.cat([prompt_ids[1:], root.view(1)])  # [a]: the token after each of them
        self.root = root

    def accept(self, tokens: torch.Tensor, features: torch.Tensor, bonus: torch.Tensor) -> None:
        # appended, not replaced: a combined proposer may skip drafting a step, leaving entries still to commit
        self.pending_features = torch.cat([self.pending_features, features])
        self.pending_tokens = torch.cat([self.pending_tokens, tokens[1:], bonus.view(1)])
        self.root = bonus

    def propose(self, spec: TreeSpec) -> DraftTree:
        if self.cache is None:  # sized for the first spec; a later, larger one is refused by check_room
            self.cache = self.level.new_cache(self.capacity + spec.cache_entries)
        root_state, self.root_logits = self._commit_pending()  # [1, h], [1, N_draft]
        self.committed = committed = self.cache.length
        self.states = root_state.new_empty(spec.drafted_nodes, root_state.shape[-1])  # [nodes, h]: state per node
        self.states[0] = root_state[0]
        entries, device = spec.cache_entries, root_state.device
        # sees[i, j]: node i attends to the step's tree entry j (its ancestors' and its own; the root's is committed)
        self.sees = torch.zeros(spec.drafted_nodes, entries, dtype=torch.bool, device=device)  # [nodes, E]
        # one mask for every depth, a slice of it per frontier: committed entries always visible
        self.mask = torch.ones(entries, committed + entries, dtype=torch.bool, device=device)  # [E, committed + E]
        self.eye = torch.eye(entries, dtype=torch.bool, device=device)  # [E, E]
        self._top_k = spec.top_k
        tree = spec.grow(self.root, self._expand)
        self.cache.rewind(committed)  # tree entries are scratch: the next step overwrites them
        return tree

    def _expand(self, frontier, tokens, parents, depth):
        if depth == 1:
            logits = self.root_logits  # [1, N_draft]: the root's
        else:
            logits = self._tree_entries(frontier, tokens, parents, depth - 1)  # [F, N_draft]
        logp = logits.float().log_softmax(-1)  # [F, N_draft]
        top = logp.topk(min(self._top_k, logp.shape[-1]), dim=-1)
        return self.drafter.token_ids[top.indices], top.values

    def _commit_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the real entries not yet in the cache (causal among themselves) and commit them; the last one's
        output state [1, h] and logits [1, N_draft] are the root's."""
        past, new = self.cache.length, self.pending_tokens.numel()
        self.cache.check_room(new)
        device = self.pending_tokens.device
        mask = torch.ones(new, past + new, dtype=torch.bool, device=device).tril(past)  # [a, past + a]: causal
        feature = self.drafter.fuse(self.pending_features)  # [a, h]
        embeds = self.embed(self.pending_tokens)
        positions = torch.arange(past, past + new, device=device)
        state, logits = self.level(feature, embeds, positions, mask, self.cache, last=True)  # [a, h], [1, N_draft]
        self.cache.commit_all(new)
        self.pending_features, self.pending_tokens = self.pending_features[:0], self.pending_tokens[:0]
        return state[-1:], logits

    def _tree_entries(self, frontier, tokens, parents, node_depth: int) -> torch.Tensor:
        """Entries for the frontier nodes (all at `node_depth`): parent's state, own token -> their logits
        [F, N_draft] (their states kept for their children).

        A frontier node sees what its parent sees (the parent was expanded one depth earlier, so its entry is
        written) and its own new entry.
        """
        count, past = frontier.numel(), self.cache.length
        self.cache.check_room(count)
        written = past - self.committed  # tree entries so far
        parent = parents[frontier]  # [F]
        sees = self.sees[parent]  # [F, E]: the parents' rows (the root's is empty)
        sees[:, written : written + count] = self.eye[:count, :count]
        self.sees[frontier] = sees
        mask = self.mask[:count, : past + count]  # [F, committed + m + F]
        mask[:, self.committed :] = sees[:, : written + count]
        feature = self.states[parent]  # [F, h]
        embeds = self.embed(tokens[frontier])
        positions = torch.full((count,), self.committed - 1 + node_depth, device=frontier.device)
        state, logits = self.level(feature, embeds, positions, mask, self.cache)  # [F, h], [F, N_draft]
        self.cache.commit_all(count)
        self.states[frontier] = state
        return logits
