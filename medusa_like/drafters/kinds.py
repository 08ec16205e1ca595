"""The two shapes of a drafter kind (`protocol.DrafterKind`), so each kind is a few lines in its drafter's module:

    WeightsKind        trained weights on disk: read and written by its codec (`formats.common.Codec`); trained by the
                       Lightning module its training config names (conf/drafter/<kind>.yaml, `training/build.py`)
    TrainingFreeKind   nothing to train or save (lookup, combined): its file operations explain what to do instead

A weights kind holds its codec as a function that imports it (`codec=`): the format modules import the drafters they
read, so a drafter module cannot import its codec before it is first used.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # formats import the drafters: a drafter module imports no format module when it is imported
    from medusa_like.formats.common import Codec


@dataclass(frozen=True)
class WeightsKind:
    name: str
    fresh: Callable  # (target, **options) -> a new drafter for the target
    codec: "Callable[[], Codec]"  # () -> its codec, imported on first use
    trainable: bool = True

    def _codec(self) -> "Codec":
        return self.codec()

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
