"""Every drafter kind by name: the one place where each shipped kind is listed, and where a kind with weights is made
from its two halves, its drafter's `fresh` (`drafters/`) and its codec (`formats/`). It sits above both, so neither
imports the other's kind objects: a codec imports the drafter it reads, and a drafter module imports no format.

    register(MY_KIND)                            # from_pretrained(drafter="my_kind"), loading, export, training
    kind_of(drafter).export(drafter, ...)        # the kind a drafter object belongs to
    kind_named("eagle3").fresh(target)           # a kind by its name (configs, checkpoints, config.json)

The framework finds a kind here by name, never by probing a drafter's type. The two shapes of a kind are in
`drafters/kinds.py`; docs/drafters.md ("Write your own drafter") walks through adding one.
"""

from medusa_like.drafters.combined import COMBINED
from medusa_like.drafters.eagle3 import fresh_eagle3
from medusa_like.drafters.kinds import WeightsKind
from medusa_like.drafters.lookup import LOOKUP
from medusa_like.drafters.medusa import fresh_heads
from medusa_like.drafters.protocol import Drafter, DrafterKind

from . import eagle3, heads_io

KINDS: dict[str, DrafterKind] = {}
_KIND_MEMBERS = ("name", "formats", "trainable", "fresh", "recognises", "read", "from_checkpoint", "export")


def register(kind: DrafterKind) -> DrafterKind:
    """Make `kind` known by its name; returns it. A second kind under a taken name is refused (registering the same
    object again changes nothing)."""
    missing = [name for name in _KIND_MEMBERS if not hasattr(kind, name)]
    if missing:
        raise TypeError(
            f"{kind!r} is not a drafter kind: it lacks {missing} (see `DrafterKind` in drafters/protocol.py, or build "
            "one with `WeightsKind` / `TrainingFreeKind` of drafters/kinds.py)"
        )
    if KINDS.get(kind.name, kind) is not kind:
        raise ValueError(f"another drafter kind is registered as {kind.name!r}; pick another name")
    KINDS[kind.name] = kind
    return kind


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


# ---------------------------------------------------------------------------------------------------------------------
# The shipped kinds: the two with weights joined here, the training-free ones as their drafter modules define them

EAGLE3 = register(WeightsKind("eagle3", fresh_eagle3, eagle3.CODEC))
MEDUSA = register(WeightsKind("medusa", fresh_heads, heads_io.CODEC))
register(LOOKUP)
register(COMBINED)
