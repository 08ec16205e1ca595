"""The two shapes of a drafter kind (`protocol.DrafterKind`), so each kind is a few lines in its drafter's module:

    WeightsKind        trained weights on disk: files through its codec in `formats/`, a Lightning module to train it
                       (built in `training/build.py`)
    TrainingFreeKind   nothing to train or save (lookup, combined): its file operations explain what to do instead

A kind's codec and its training module's builder are named as "module:attribute" and imported when first used,
because the format modules import the drafters they read, and the training modules the drafters they train.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass


def named_attribute(name: str):
    """The object a "module:attribute" name names, its module imported now."""
    module, attribute = name.split(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class WeightsKind:
    name: str
    codec: str  # "module:attribute" of its `formats.common.Codec`
    fresh: Callable  # (target, **options) -> a new drafter for the target
    trainer: str  # "module:attribute" of (cfg, target, **shared) -> the Lightning module that trains it
    trainable: bool = True

    def _codec(self):
        return named_attribute(self.codec)

    def training_module(self, cfg, target, **shared):
        return named_attribute(self.trainer)(cfg, target, **shared)

    @property
    def formats(self) -> tuple[str, ...]:
        return self._codec().formats

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

    def training_module(self, cfg, target, **shared):
        self._refuse("nothing to train")
