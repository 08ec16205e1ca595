"""Lookup drafting: no training, no weights. The target repeats its prompt and itself, so what followed the current
suffix earlier is a good guess of what follows now. A `LookupDrafter` (kind "lookup") is the two lookup sources
(`lookup_sources.py`: this generation's own text, and an output store of the target's earlier answers) behind the
combined proposer with no learned drafter: `MedusaLikeModel.from_pretrained(target, drafter="lookup")`.
"""

import copy
from collections.abc import Iterator
from pathlib import Path

import torch

from medusa_like.targets import weights_fingerprint

from ..decoding.tree import DEFAULT_LOOKUP_DEPTH, TreeSpec, budgeted
from .kinds import TrainingFreeKind
from .lookup_sources import DEFAULT_STORE_TOKENS, ContextLookup, OutputStore
from .merged_tree import MergedTreeProposer, SessionState
from .registry import register


class LookupDrafter:
    """Context lookup and an output store, merged into one cost-aware tree (`drafters/merged_tree.py`) with no
    learned drafter. Lossless like any drafter; needs no training."""

    kind = "lookup"
    max_depth = None

    def __init__(
        self,
        store: OutputStore | None = None,
        context: ContextLookup | None = None,
        lookup_depth: int = DEFAULT_LOOKUP_DEPTH,
        use: tuple[str, ...] = ("context", "store"),
    ):
        self.store = store if store is not None else OutputStore()
        self.context = context or ContextLookup()
        if isinstance(lookup_depth, bool) or not isinstance(lookup_depth, int) or lookup_depth < 1:
            raise ValueError(
                f"lookup_depth: expected a positive integer (tokens a lookup drafts), got {lookup_depth!r}"
            )
        self.lookup_depth = lookup_depth
        unknown = set(use) - {"context", "store"}
        if unknown or not use:
            raise ValueError(f"lookup sources are 'context' and 'store', got {list(use)}")
        self.use = tuple(use)
        self.state = SessionState()  # calibration and cost model, kept across generations

    def sources(self) -> list:
        """The sources of one generation's proposer: its own context lookup (each row of a batch indexes its own
        text), the shared output store (read while decoding, added to once an answer is done)."""
        return [source for source in (copy.copy(self.context), self.store) if source.name in self.use]

    @property
    def cost_model(self):
        return self.state.cost_model

    def use_cost_model(self, cost) -> None:
        self.state.cost_model = cost

    def proposer(self, target) -> MergedTreeProposer:
        return MergedTreeProposer(target, None, self.sources(), self.state)

    def parts(self) -> dict:
        return {}

    def fork(self) -> "LookupDrafter":
        forked = copy.copy(self)
        forked.state = self.state.fork()
        return forked

    def check_fits(self, target) -> None:
        self.store.check_fits(target)

    def adapt_tree(self, spec: TreeSpec) -> TreeSpec:
        """Lookup fills no ranked tree: only the budget (nodes) and depth of `spec` are kept."""
        return budgeted(spec, lookup_depth=self.lookup_depth, keep_learned=False)

    def remember(self, tokens: list[int]) -> None:
        self.store.add(tokens)

    def to(self, device=None, dtype=None) -> "LookupDrafter":
        return self  # no tensors

    def modules(self) -> Iterator[torch.nn.Module]:
        return iter(())


def fresh_lookup(
    target,
    store: str | Path | OutputStore | None = None,
    max_store_tokens: int = DEFAULT_STORE_TOKENS,
    lookup_depth: int = DEFAULT_LOOKUP_DEPTH,
    use: tuple[str, ...] = ("context", "store"),
) -> LookupDrafter:
    """Context lookup and an output store: empty, or loaded from `store` (a file `OutputStore.save` wrote);
    `use` picks the sources."""
    if isinstance(store, (str, Path)):
        store = OutputStore.load(store, target)
    elif store is None:
        store = OutputStore(max_store_tokens, fingerprint=weights_fingerprint(target))
    return LookupDrafter(store, lookup_depth=lookup_depth, use=tuple(use))


LOOKUP = register(TrainingFreeKind("lookup", fresh_lookup, "save and load its store with OutputStore.save / .load"))
