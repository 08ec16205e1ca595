"""Every drafter kind by name. A kind is one object in its drafter's own module (see `protocol.DrafterKind` and the two
shapes in `kinds.py`); `register` makes it known to everything that takes a kind's name, and the framework finds it
here by name, never by probing a drafter's type.

    register(MY_KIND)                            # from_pretrained(drafter="my_kind"), loading, export, training
    kind_of(drafter).export(drafter, ...)        # the kind a drafter object belongs to
    kind_named("eagle3").fresh(target)           # a kind by its name (configs, checkpoints, config.json)

The kinds shipped with the package are registered at the bottom of this module; docs/drafters.md ("Write your own
drafter") walks through adding one.
"""

import inspect

from .combined import COMBINED
from .eagle3 import EAGLE3
from .lookup import LOOKUP
from .medusa import MEDUSA
from .protocol import Drafter, DrafterKind

KINDS: dict[str, DrafterKind] = {}
_KIND_MEMBERS = ("name", "formats", "trainable", "fresh", "recognises", "read", "from_checkpoint", "export")


def register(kind: DrafterKind) -> DrafterKind:
    """Make `kind` known by its name; returns it. A second kind under a taken name is refused (registering the same
    object again changes nothing)."""
    missing = [name for name in _KIND_MEMBERS if not _has(kind, name)]
    if missing:
        raise TypeError(
            f"{kind!r} is not a drafter kind: it lacks {missing} (see `DrafterKind` in drafters/protocol.py, or build "
            "one with `WeightsKind` / `TrainingFreeKind` of drafters/kinds.py)"
        )
    if KINDS.get(kind.name, kind) is not kind:
        raise ValueError(f"another drafter kind is registered as {kind.name!r}; pick another name")
    KINDS[kind.name] = kind
    return kind


def _has(kind, name: str) -> bool:
    """Whether `kind` has `name`, without computing it (a weights kind's `formats` would import its codec)."""
    try:
        inspect.getattr_static(kind, name)
    except AttributeError:
        return False
    return True


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


for _kind in (EAGLE3, MEDUSA, LOOKUP, COMBINED):
    register(_kind)
