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

A drafter kind (`medusa`, `eagle3`, `lookup`, `combined`) is one object in the drafter's own module, made known by
`registry.register`: everything the framework asks about a kind (build one, read and write its files) goes through it.
A kind with weights also has a codec in `formats/` (held by the kind) and a Lightning module in `training/` (named by
its training config, conf/drafter/<kind>.yaml). docs/drafters.md ("Write your own drafter") shows the steps.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

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
    """A drafter object: trained weights (an `nn.Module`) or a training-free source. `DrafterBase` below answers
    `wants_cost_model`, `cost_model`, `use_cost_model`, `compile_drafting`, `parts` and `fork` for the drafters that
    need nothing else."""

    kind: str  # its `DrafterKind`'s name in the registry
    max_depth: int | None  # the deepest static tree it can fill; None: any
    # casts the target's states it reads to its own dtype, so it may compute in another dtype than the target
    # (`forward.PreparedTarget.drafting_dtype`); absent: False
    computes_in_own_dtype: bool
    wants_cost_model: bool  # sizes its trees by this machine's cost model (lookup, combined): the framework sets one
    cost_model: CostModel | None  # the one it sizes trees by (None: none set, or it consults none)

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

    def use_cost_model(self, cost: CostModel) -> None:
        """Size trees by `cost` from the next generation on (drafters that consult none ignore it)."""
        ...

    def compile_drafting(self, compiler) -> None:
        """Draft through what `compiler` compiles from now on (`forward/compiled_draft.DraftCompiler`:
        `compiler.level(module)` for an EAGLE-3-style level, `compiler.heads(module, rows)` for Medusa-style heads),
        where the drafter computes something to compile; drafters with nothing ignore it."""
        ...

    def parts(self) -> dict[str, "Drafter"]:
        """The drafters it merges, by role ("learned", "lookup"), each of which can decode alone; {} for one source."""
        ...

    def fork(self) -> "Drafter":
        """A drafter sharing its weights, sources and cost model, with its own copy of what it learns across
        generations (calibration, the learned drafter's gate): what a tree search times each candidate with."""
        ...

    def to(self, device=None, dtype=None) -> "Drafter": ...

    def eval(self) -> "Drafter": ...

    def modules(self) -> Iterator[torch.nn.Module]:
        """The torch modules it computes with (none for lookup), as `nn.Module.modules` gives them."""
        ...


class DrafterBase:
    """The answers of a drafter that sizes no tree by a cost model, merges no parts and learns nothing across
    generations: subclass it and write the rest of `Drafter`."""

    wants_cost_model = False
    cost_model = None

    def use_cost_model(self, cost: CostModel) -> None:
        pass  # its trees are the spec's, whatever the machine

    def compile_drafting(self, compiler) -> None:
        pass  # nothing of its own to compile

    def parts(self) -> dict:
        return {}

    def fork(self) -> "DrafterBase":
        return self


class DrafterKind(Protocol):
    name: str
    formats: tuple[str, ...]  # what `export` writes; "native" (read back by `read`) first; () if nothing to save
    trainable: bool  # trained weights: a codec and a Lightning module (conf/drafter/<name>.yaml names it)

    def fresh(self, target, **options) -> Drafter:
        """A new drafter for `target` (untrained weights, or an empty lookup source), from config options."""
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
