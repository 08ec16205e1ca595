"""The two shapes of a drafter kind (`protocol.DrafterKind`), so each kind is a few lines:

    WeightsKind        trained weights on disk: read and written by its `Codec` (one per kind, in `formats/`); trained by
                       the Lightning module its training config names (conf/drafter/<kind>.yaml, `training/build.py`)
    TrainingFreeKind   nothing to train or save (lookup, combined): its file operations explain what to do instead

A training-free kind is one object in its drafter's module. A weights kind joins a drafter's `fresh` with the codec of
its files, and the codecs import the drafters they read, so it is made above both: the shipped ones in
`formats/registry.py`, where every kind is listed.
"""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Codec:
    """A weights kind's files, both directions: what its format module in `formats/` hands its `WeightsKind`."""

    formats: tuple[str, ...]  # what `export` writes; "native" first
    recognises: Callable[[dict], bool]  # config.json -> written by one of these formats?
    read: Callable  # (directory, target) -> (drafter, meta)
    from_checkpoint: Callable  # (loaded checkpoint, path, target) -> (drafter, meta)
    export: Callable  # (drafter, out_dir, format, target, target_name, dtype, overwrite) -> out_dir


@dataclass(frozen=True)
class WeightsKind:
    name: str
    fresh: Callable  # (target, **options) -> a new drafter for the target
    codec: Codec  # its files, both directions
    trainable: bool = True

    @property
    def formats(self) -> tuple[str, ...]:
        return self.codec.formats

    def recognises(self, config: dict) -> bool:
        return self.codec.recognises(config)

    def read(self, path, target):
        return self.codec.read(path, target)

    def from_checkpoint(self, checkpoint: dict, path, target):
        return self.codec.from_checkpoint(checkpoint, path, target)

    def export(self, drafter, out_dir, format, target, target_name, dtype=None, overwrite=False):
        return self.codec.export(drafter, out_dir, format, target, target_name, dtype, overwrite)


@dataclass(frozen=True)
class TrainingFreeKind:
    name: str
    fresh: Callable  # (target, **options) -> a new drafter for the target
    instead: str  # what a user saves, loads or trains instead, for the errors
    trainable: bool = False
    formats: tuple[str, ...] = ()

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
