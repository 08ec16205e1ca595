"""The two shapes of a drafter kind (`protocol.DrafterKind`), so that each kind is a few lines in its drafter's module:

    WeightsKind        trained weights on disk, read and written by its `Codec` (one per kind, in `formats/`, which
                       attaches it: `KIND.attach(CODEC)`); trained by the Lightning module its training config names
                       (conf/drafter/<kind>.yaml, `training/build.py`)
    TrainingFreeKind   nothing to train or save (lookup, combined): its file operations explain what to do instead

A kind is defined and registered (`registry.register`) in its drafter's module. The codecs import the drafters they
read, so a drafter module never imports its codec: the codec's module attaches it to the kind when `medusa_like.formats`
is imported, which every caller of the file operations does first.
"""

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Codec:
    """A weights kind's files, both directions: what its format module in `formats/` attaches to its `WeightsKind`."""

    formats: tuple[str, ...]  # what `export` writes; "native" first
    recognises: Callable[[dict], bool]  # config.json -> written by one of these formats?
    read: Callable  # (directory, target) -> (drafter, meta)
    from_checkpoint: Callable  # (loaded checkpoint, path, target) -> (drafter, meta)
    export: Callable  # (drafter, out_dir, format, target, target_name, dtype, overwrite) -> out_dir


@dataclass(eq=False)
class WeightsKind:
    name: str
    fresh: Callable  # (target, **options) -> a new drafter for the target
    # (drafter, target, sequence [1, L], prompt length) -> per-depth ranks of the right token, for kinds whose depth-d
    # candidates do not depend on the path (`DrafterKind.depth_ranks`); None: the kind's trees are dynamic
    ranks: Callable | None = None
    # (drafter, DraftVocab) -> None: restrict a drafter that projects through the target's own output layer to a
    # draft vocabulary's rows after training (`DrafterKind.restrict_vocab`); None: its vocabulary is fixed in training
    restrict: Callable | None = None
    trainable: bool = True
    takes_learned: bool = False
    codec: Codec | None = field(default=None, repr=False)  # attached by its format module (`attach`)

    def attach(self, codec: Codec) -> None:
        """The kind's files, from its format module in `formats/`."""
        self.codec = codec

    def _codec(self) -> Codec:
        if self.codec is None:
            raise RuntimeError(
                f"the {self.name} kind's files are read and written by its codec, which `medusa_like.formats` "
                "attaches: import medusa_like.formats first"
            )
        return self.codec

    @property
    def formats(self) -> tuple[str, ...]:
        return self._codec().formats

    def learned_part(self, drafter):
        return drafter  # the trained weights are the drafter

    @property
    def static_trees(self) -> bool:
        return self.ranks is not None

    def depth_ranks(self, drafter, target, sequence, prompt_len: int):
        return None if self.ranks is None else self.ranks(drafter, target, sequence, prompt_len)

    def restrict_vocab(self, drafter, vocab) -> None:
        if self.restrict is None:
            raise ValueError(
                f"a {self.name} drafter's vocabulary is fixed in training: a draft vocabulary restricts only drafters "
                "that project through the target's own output layer (Medusa heads)"
            )
        self.restrict(drafter, vocab)

    def recognises(self, config: dict) -> bool:
        return self._codec().recognises(config)

    def read(self, path, target):
        return self._codec().read(path, target)

    def from_checkpoint(self, checkpoint: dict, path, target):
        return self._codec().from_checkpoint(checkpoint, path, target)

    def export(self, drafter, out_dir, format, target, target_name, dtype=None, overwrite=False):
        return self._codec().export(drafter, out_dir, format, target, target_name, dtype, overwrite)


@dataclass(frozen=True)
class TrainingFreeKind:
    name: str
    fresh: Callable  # (target, **options) -> a new drafter for the target
    instead: str  # what a user saves, loads or trains instead, for the errors
    learned: Callable = lambda drafter: None  # drafter -> its trained part (a combined drafter's learned drafter)
    takes_learned: bool = False
    trainable: bool = False
    formats: tuple[str, ...] = ()
    static_trees: bool = False  # its trees are budgeted, never static trees from rank accuracies

    def learned_part(self, drafter):
        return self.learned(drafter)

    def depth_ranks(self, drafter, target, sequence, prompt_len: int):
        return None  # its trees are budgeted, never static trees from rank accuracies

    def restrict_vocab(self, drafter, vocab) -> None:
        raise ValueError(f"a {self.name} drafter has no projection to restrict to a draft vocabulary")

    def recognises(self, config: dict) -> bool:
        return False

    def _refuse(self, what: str):
        raise ValueError(f"a {self.name} drafter has {what}: {self.instead}")

    def read(self, path, target):
        self._refuse(f"no files to read at {path}")

    def from_checkpoint(self, checkpoint: dict, path, target):
        self._refuse(f"no training checkpoints ({path})")

    def export(self, drafter, out_dir, format, target, target_name, dtype=None, overwrite=False):
        self._refuse("no weights to export")
