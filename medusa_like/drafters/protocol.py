"""The interfaces between the framework and any drafter: what the decoding loop calls (`Proposer`), what a drafter
object is (`Drafter`) and what a drafter kind knows (`DrafterKind`).

The loop owns the target, its KV cache, verification, acceptance and sampling; a drafter only proposes. Each step:

    tree = proposer.propose(spec)                       # a DraftTree rooted at the target's own next token
    ... the target verifies the whole tree in one forward and accepts a path ...
    proposer.accept(tokens, features, bonus)            # the accepted nodes, their target features, the new root

`features` are what the drafter reads from the target at each position: the concatenated `hidden_states[i]` for
`i in feature_layers` (EAGLE-3's low, middle and high layers), or the last hidden state after the final norm when
`feature_layers` is None (Medusa heads; lookup drafters ignore them). Whatever a proposer proposes, the target decides
what is kept, so any proposer is lossless; a good one is only faster.

A drafter kind (`medusa`, `eagle3`, `lookup`, `combined`) is one object in the drafter's own module, registered there
(`registry.register`): everything the framework asks that differs by kind (build one, its learned part, how its trees
are searched, read and write its files) goes through it. A kind with weights also has a codec in `formats/` (attached
to the kind by its format module) and a Lightning module in `training/` (named by its training config,
conf/drafter/<kind>.yaml). docs/drafters.md ("Write your own drafter") shows the steps.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from ..decoding.cost_model import CostModel
from ..decoding.draft_tree import DraftTree
from ..decoding.tree import TreeSpec


class Proposer(Protocol):
    feature_layers: tuple[int, ...] | None  # hidden_states the drafter reads; None: the last hidden state
    max_depth: int | None  # the deepest static tree it can fill (Medusa: its heads); None: any
    max_rank: int | None  # candidates it can rank after a node (its vocabulary); None: any

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor, root: torch.Tensor, capacity: int) -> None:
        """Start a sequence: prompt_ids [P], the target's features at every prompt position [P, F], the root token
        (the target's next token after the prompt) and room for `capacity` committed tokens."""
        ...

    def propose(self, spec: TreeSpec) -> DraftTree:
        """A candidate tree rooted at the current root token, within `spec` (at most `spec.max_nodes` nodes)."""
        ...

    def accept(self, tokens: torch.Tensor, features: torch.Tensor, bonus: torch.Tensor) -> None:
        """The accepted nodes' tokens [a] (root first), their target features [a, F] and the next root token."""
        ...


class Drafter(Protocol):
    """A drafter object, as the decoding core and the public API use it: trained weights (an `nn.Module`) or a
    training-free source. What only drafters that size their trees by a cost model answer is the optional protocol
    `BudgetedDrafter` below; what the forward room asks of a drafter with weights is its own (`forward.TunedDrafter`:
    the dtype it may compute in, what it drafts with compiled), which every learned drafter implements."""

    kind: str  # its `DrafterKind`'s name in the registry (`registry.py`)
    max_depth: int | None  # the deepest static tree it can fill; None: any

    def proposer(self, target) -> Proposer:
        """A fresh proposer for one generation with `target`."""
        ...

    def check_fits(self, target) -> None:
        """Raise `DrafterMismatchError` (drafters/base.py) when it was made for another target."""
        ...

    def adapt_tree(self, spec: TreeSpec) -> TreeSpec:
        """The spec this drafter decodes with when asked for `spec` (a combined drafter merges lookup into it)."""
        ...

    def remember(self, tokens: list[int]) -> None:
        """A finished output of the target (lookup stores learn from it; learned drafters ignore it)."""
        ...

    def to(self, device=None, dtype=None) -> "Drafter": ...

    def modules(self) -> Iterator[torch.nn.Module]:
        """The torch modules it computes with (none for lookup), as `nn.Module.modules` gives them."""
        ...


@runtime_checkable
class BudgetedDrafter(Protocol):
    """Optional: a drafter whose trees are cut to a budget by this machine's cost model (lookup, combined), as the
    public API sets it up and the tree search times it."""

    cost_model: CostModel | None  # the one it sizes trees by (None: none set yet)

    def use_cost_model(self, cost: CostModel) -> None:
        """Size trees by `cost` from the next generation on."""
        ...

    def parts(self) -> dict[str, "Drafter"]:
        """The drafters it merges, by role ("learned", "lookup"), each of which can decode alone; {} for one source."""
        ...

    def fork(self) -> "BudgetedDrafter":
        """A drafter sharing its weights, sources and cost model, with its own copy of what it learns across
        generations (calibration, the learned drafter's gate): what a tree search times each candidate with."""
        ...


def sized_by_cost_model(drafter) -> bool:
    """Whether `drafter` sizes its trees by a cost model (implements `BudgetedDrafter`)."""
    return isinstance(drafter, BudgetedDrafter)


class DrafterKind(Protocol):
    """A kind of drafter (`kinds.py` builds one in a few lines): everything the framework asks that differs by kind,
    so that no code outside a kind's own modules tests a kind's name."""

    name: str
    formats: tuple[str, ...]  # what `export` writes; "native" (read back by `read`) first; () if nothing to save
    trainable: bool  # trained weights: a codec and a Lightning module (conf/drafter/<name>.yaml names it)
    takes_learned: bool  # `fresh` takes a learned drafter to merge with its own sources (`learned=`: combined)
    static_trees: bool  # its drafters decode static trees built from their rank accuracies (`depth_ranks`)

    def fresh(self, target, **options) -> Drafter:
        """A new drafter for `target` (untrained weights, or an empty lookup source), from config options."""
        ...

    def learned_part(self, drafter) -> Drafter | None:
        """The trained part of one of this kind's drafters (itself, a combined drafter's learned drafter), or None
        (lookup): what its weights, parameter count and dtype are read from."""
        ...

    def depth_ranks(self, drafter, target, sequence: torch.Tensor, prompt_len: int):
        """Per depth d = 1..D, the rank of the right token among the drafter's depth-d candidates at every answer
        position of one sequence [1, L], teacher-forced (`decoding/tree_presets.target_ranks`): for kinds whose
        depth-d candidates do not depend on the path above them (Medusa heads), from whose rank accuracies static
        trees are built; None for the others, whose trees are dynamic."""
        ...

    def restrict_vocab(self, drafter, vocab) -> None:
        """Restrict a trained drafter's projection to a draft vocabulary's rows (`drafters/vocab.DraftVocab`), for
        kinds that project through the target's own output layer (Medusa heads); refused (ValueError) by the others."""
        ...

    def recognises(self, config: dict) -> bool:
        """Whether a drafter directory's config.json was written by one of this kind's formats."""
        ...

    def read(self, path: Path, target) -> tuple[Drafter, dict]:
        """(drafter, what the files say about themselves) from a directory in one of this kind's formats."""
        ...

    def from_checkpoint(self, checkpoint: dict, path: Path, target) -> tuple[Drafter, dict]:
        """A drafter from a Lightning checkpoint written by this kind's training module."""
        ...

    def export(self, drafter, out_dir: Path, format: str, target, target_name: str, dtype, overwrite: bool) -> Path: ...
