"""Every drafter kind by name. A kind is one object (`kinds.py`), defined and registered in its drafter's own module;
the shipped kinds are found by importing every module of this package once, so adding a kind touches only its own
files (its drafter module, its codec in `formats/`, its Lightning module and config).

    register(MY_KIND)                            # from_pretrained(drafter="my_kind"), loading, export, training
    kind_of(drafter).learned_part(drafter)       # the kind a drafter object belongs to, asked what differs by kind
    kind_named("eagle3").fresh(target)           # a kind by its name (configs, checkpoints, config.json)
    all_kinds()                                  # {name: kind}, every shipped and registered kind

The framework asks a kind what differs between kinds (`protocol.DrafterKind`), never tests a kind's name or probes a
drafter's type. docs/drafters.md ("Write your own drafter") walks through adding one.
"""

import importlib
import pkgutil

from .protocol import Drafter, DrafterKind

_KINDS: dict[str, DrafterKind] = {}
_KIND_MEMBERS = (
    "name", "formats", "trainable", "takes_learned", "static_trees", "fresh", "learned_part", "depth_ranks", "restrict_vocab", "recognises", "read",
    "from_checkpoint", "export",
)  # fmt: skip
_discovered = False


def register(kind: DrafterKind) -> DrafterKind:
    """Make `kind` known by its name; returns it. A second kind under a taken name is refused (registering the same
    object again changes nothing)."""
    missing = [name for name in _KIND_MEMBERS if not hasattr(type(kind), name) and name not in vars(kind)]
    if missing:
        raise TypeError(
            f"{kind!r} is not a drafter kind: it lacks {missing} (see `DrafterKind` in drafters/protocol.py, or build "
            "one with `WeightsKind` / `TrainingFreeKind` of drafters/kinds.py)"
        )
    if _KINDS.get(kind.name, kind) is not kind:
        raise ValueError(f"another drafter kind is registered as {kind.name!r}; pick another name")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Forget the kind registered as `name` (a kind registered for a while: a test's)."""
    _KINDS.pop(name, None)


def all_kinds() -> dict[str, DrafterKind]:
    """Every kind by name: the shipped ones (each module of this package imported once) and any registered since."""
    global _discovered
    if not _discovered:
        _discovered = True
        for module in pkgutil.iter_modules(_package_path()):
            importlib.import_module(f"{__package__}.{module.name}")
    return dict(_KINDS)


def _package_path():
    return importlib.import_module(__package__).__path__


def kind_named(name: str) -> DrafterKind:
    kinds = all_kinds()
    if name not in kinds:
        raise ValueError(f"unknown drafter kind {name!r}; known kinds: {sorted(kinds)}")
    return kinds[name]


def kind_of(drafter: Drafter) -> DrafterKind:
    try:
        name = drafter.kind
    except AttributeError:
        raise TypeError(f"{type(drafter).__name__} is not a drafter (it names no drafter kind)") from None
    return kind_named(name)


def trainable_kinds() -> list[str]:
    """The names of the kinds with weights to train, sorted."""
    return sorted(name for name, kind in all_kinds().items() if kind.trainable)
