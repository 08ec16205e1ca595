"""The one protocol between the decoding loop and any drafter.

The loop owns the target, its KV cache, verification, acceptance and sampling; a drafter only proposes. Each step:

    tree = proposer.propose(spec)                       # a DraftTree rooted at the target's own next token
    ... the target verifies the whole tree in one forward and accepts a path ...
    proposer.accept(tokens, features, bonus)            # the accepted nodes, their target features, the new root

`features` are what the drafter reads from the target at each position: the concatenated `hidden_states[i]` for
`i in feature_layers` (EAGLE-3's low, middle and high layers), or the last hidden state after the final norm when
`feature_layers` is None (Medusa heads). Whatever a proposer proposes, the target decides what is kept, so any
proposer is lossless; a good one is only faster.
"""

from typing import Protocol

import torch

from ..decoding.draft_tree import DraftTree
from ..decoding.tree import DynamicTreeSpec, TokenTree

TreeSpec = TokenTree | DynamicTreeSpec


class Proposer(Protocol):
    feature_layers: tuple[int, ...] | None

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor, root: torch.Tensor, capacity: int) -> None:
        """Start a sequence: prompt_ids [P], the target's features at every prompt position [P, F], the root token
        (the target's next token after the prompt) and room for `capacity` committed tokens."""
        ...

    def propose(self, spec: TreeSpec) -> DraftTree:
        """A candidate tree rooted at the current root token, static (a `TokenTree`) or dynamic."""
        ...

    def accept(self, tokens: torch.Tensor, features: torch.Tensor, bonus: torch.Tensor) -> None:
        """The accepted nodes' tokens [a] (root first), their target features [a, F] and the next root token."""
        ...


def tree_entries(spec: TreeSpec) -> int:
    """Drafter entries one step can write beyond the committed ones (the drafter's own cache must hold them)."""
    if isinstance(spec, DynamicTreeSpec):
        return spec.depth * spec.top_k
    return spec.num_nodes
