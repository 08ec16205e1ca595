"""The combined drafter kind: a learned drafter (EAGLE-3 or Medusa heads) and lookup (context, output store) merged
into one cost-aware tree each step by `merge.CombinedProposer` (see `drafters/merge.py`).

    model = MedusaLikeModel.from_pretrained(target, drafter="combined", learned="runs/x/drafter")
"""

from collections.abc import Iterator

import torch

from medusa_like.decoding.cost_model import CostModel
from medusa_like.decoding.tree import TreeSpec, budgeted

from .kinds import TrainingFreeKind
from .lookup import LOOKUP
from .merge import CombinedProposer, SessionState
from .protocol import Drafter


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
        return getattr(self.learned, "computes_in_own_dtype", False)

    def proposer(self, target) -> CombinedProposer:
        return CombinedProposer(target, self.learned, self.lookup.sources(), self.state)

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

    def eval(self) -> "CombinedDrafter":
        self.learned = self.learned.eval()
        return self

    def modules(self) -> Iterator[torch.nn.Module]:
        return self.learned.modules()


def fresh_combined(
    target, learned: str | Drafter = "eagle3", store=None, cost_model: CostModel | None = None, **options
) -> CombinedDrafter:
    """A learned drafter (an object, or the name of a trainable kind such as "eagle3" or "medusa" for a fresh one built
    with `options`; `formats.resolve_drafter` loads one named by a directory or checkpoint first) with context lookup
    and an output store (empty, or loaded from `store`)."""
    if isinstance(learned, str):
        from .registry import KINDS  # the registry lists this kind too, so it is read when a drafter is built

        trainable = sorted(name for name, kind in KINDS.items() if kind.trainable)
        if learned not in trainable:
            raise ValueError(
                f"learned={learned!r}: a learned drafter, one of {trainable} for a fresh one, or a drafter "
                "directory or checkpoint through MedusaLikeModel.from_pretrained / formats.resolve_drafter"
            )
        learned = KINDS[learned].fresh(target, **options)
    return CombinedDrafter(learned, LOOKUP.fresh(target, store=store), cost_model)


COMBINED = TrainingFreeKind(
    "combined",
    fresh_combined,
    "save or train its learned drafter (drafter.learned), and its store with OutputStore.save",
)
