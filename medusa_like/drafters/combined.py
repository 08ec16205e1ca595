"""The combined drafter kind: a learned drafter (EAGLE-3 or Medusa heads) and lookup (context, output store) merged
into one cost-aware tree each step by `merged_tree.MergedTreeProposer`.

    model = MedusaLikeModel.from_pretrained(target, drafter="combined", learned="runs/x/drafter")
"""

import copy
from collections.abc import Iterator
from pathlib import Path

import torch

from medusa_like.decoding.cost_model import CostModel
from medusa_like.decoding.tree import TreeSpec, budgeted

from .kinds import TrainingFreeKind
from .lookup import LOOKUP
from .merged_tree import MergedTreeProposer, SessionState
from .protocol import Drafter
from .registry import register


class CombinedDrafter:
    """A learned drafter and lookup sources behind one cost-aware tree."""

    kind = "combined"

    def __init__(self, learned, lookup, cost_model: CostModel | None = None):
        self.learned = learned
        self.lookup = lookup  # a `LookupDrafter`: its sources and output store
        self.state = SessionState(cost_model)

    @property
    def max_depth(self) -> int | None:
        return self.learned.max_depth

    @property
    def computes_in_own_dtype(self) -> bool:
        return self.learned.computes_in_own_dtype  # a learned drafter answers the forward room (`forward.TunedDrafter`)

    @property
    def cost_model(self) -> CostModel | None:
        return self.state.cost_model

    def use_cost_model(self, cost: CostModel) -> None:
        self.state.cost_model = cost

    def compile_drafting(self, compiler) -> None:
        self.learned.compile_drafting(compiler)

    def proposer(self, target) -> MergedTreeProposer:
        return MergedTreeProposer(target, self.learned, self.lookup.sources(), self.state)

    def parts(self) -> dict[str, Drafter]:
        return {"learned": self.learned, "lookup": self.lookup}

    def fork(self) -> "CombinedDrafter":
        forked = copy.copy(self)
        forked.state = self.state.fork()
        return forked

    def check_fits(self, target) -> None:
        self.learned.check_fits(target)
        self.lookup.check_fits(target)

    def adapt_tree(self, spec: TreeSpec) -> TreeSpec:
        return budgeted(spec, lookup_depth=self.lookup.lookup_depth)

    def remember(self, tokens: list[int]) -> None:
        self.lookup.remember(tokens)

    def to(self, device=None, dtype=None) -> "CombinedDrafter":
        self.learned = self.learned.to(device=device, dtype=dtype)
        return self

    def modules(self) -> Iterator[torch.nn.Module]:
        return self.learned.modules()


def fresh_combined(target, learned: Drafter, store=None, cost_model: CostModel | None = None) -> CombinedDrafter:
    """A learned drafter object with context lookup and an output store (empty, or loaded from `store`).
    `formats.resolve_drafter` makes the learned drafter from what a user names (a trainable kind's name, a directory
    or a checkpoint)."""
    if isinstance(learned, (str, Path)):
        raise TypeError(
            f"learned={learned!r}: a learned drafter object (MedusaLikeModel.from_pretrained and "
            "formats.resolve_drafter take a kind's name, a drafter directory or a checkpoint)"
        )
    return CombinedDrafter(learned, LOOKUP.fresh(target, store=store), cost_model)


COMBINED = register(
    TrainingFreeKind(
        "combined",
        fresh_combined,
        "save or train its learned drafter (drafter.learned), and its store with OutputStore.save",
        learned=lambda drafter: drafter.learned,
        takes_learned=True,
    )
)
