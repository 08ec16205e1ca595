"""Every drafter kind, listed once. A kind is one object in its drafter's own module (see `protocol.DrafterKind`);
the framework finds it here by name, never by probing a drafter's type.

    kind_of(drafter).export(drafter, ...)        # the kind a drafter object belongs to
    kind_named("eagle3").fresh(target)           # a kind by its name (configs, checkpoints, config.json)
"""

from .combined import COMBINED
from .eagle3 import EAGLE3
from .lookup import LOOKUP
from .medusa import MEDUSA
from .protocol import Drafter, DrafterKind

KINDS: dict[str, DrafterKind] = {kind.name: kind for kind in (EAGLE3, MEDUSA, LOOKUP, COMBINED)}


def kind_named(name: str) -> DrafterKind:
    if name not in KINDS:
        raise ValueError(f"unknown drafter kind {name!r}; known kinds: {sorted(KINDS)}")
    return KINDS[name]


def kind_of(drafter: Drafter) -> DrafterKind:
    try:
        name = drafter.kind
    except AttributeError:
        raise TypeError(f"{type(drafter).__name__} is not a drafter (it names no drafter kind)") from None
    return kind_named(name)
