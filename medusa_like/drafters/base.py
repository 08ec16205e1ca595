"""The one rule for "does this drafter fit this target?", shared by loading, export and training.

A drafter fits a target when it reads hidden states of the target's width and proposes tokens of the target's
vocabulary; when the drafter records the target's architecture fingerprint (native files, training checkpoints),
that must match too. Anything else is a `DrafterMismatchError` naming both values. `LearnedDrafter` applies it to
the trained drafters (Medusa heads, EAGLE-3), which answer the rest of the `Drafter` protocol's bookkeeping alike.
"""

import logging

from medusa_like.decoding.tree import TreeSpec
from medusa_like.targets import target_fingerprint, weights_fingerprint, weights_identity

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "medusa_like"  # the training module's entry in a Lightning checkpoint


class DrafterMismatchError(ValueError):
    """A drafter that does not fit the target it is loaded onto, exported for or trained with."""


def target_name(target) -> str:
    return getattr(target.config, "name_or_path", None) or type(target).__name__


def check_fits(
    hidden_size: int,
    vocab_size: int,
    target,
    fingerprint: str | None = None,
    source: str = "",
    weights: str | None = None,
) -> None:
    """Raise DrafterMismatchError naming what differs: hidden size, vocabulary or the architecture fingerprint; warn
    (`check_weights`) when the drafter records other target weights of the same architecture.

    `source` completes "drafter ... has": e.g. "from runs/x/drafter" or "being exported".
    """
    config = target.config.get_text_config()
    name = target_name(target)
    what = f"drafter {source}".strip()
    if hidden_size != config.hidden_size:
        raise DrafterMismatchError(
            f"{what} reads hidden size {hidden_size}, but target {name!r} has hidden size {config.hidden_size}"
        )
    if vocab_size != config.vocab_size:
        raise DrafterMismatchError(
            f"{what} has vocabulary size {vocab_size}, but target {name!r} has vocabulary size {config.vocab_size}"
        )
    actual = target_fingerprint(target.config)
    if fingerprint is not None and fingerprint != actual:
        raise DrafterMismatchError(
            f"{what} was trained on a target with fingerprint {fingerprint}, but target {name!r} has fingerprint "
            f"{actual}: same hidden size and vocabulary, another architecture (layers, attention heads or MLP size)"
        )
    check_weights(weights, target, what)


def check_weights(weights: str | None, target, what: str = "drafter") -> None:
    """A drafter trained for other weights of the target's architecture (another checkpoint, a fine-tune) is loaded
    with a warning naming both weights fingerprints, not refused: decoding stays lossless, since the target verifies
    every draft, and a drafter trained on a base model may serve its fine-tune, but it drafts for the weights it
    learned, so its acceptance here may be far lower. `weights`: what the drafter records (None: nothing recorded)."""
    if weights is None:
        return
    actual = weights_identity(target)  # what drafters record: the same weights in any dtype are the same target
    if weights not in (actual, weights_fingerprint(target)):  # the fingerprint: what earlier versions recorded
        log.warning(
            "%s was trained for target weights %s, but target %r has weights %s (same architecture, other weights: "
            "lossless still, but expect lower acceptance; train it for these weights)",
            what, weights, target_name(target), actual,
        )  # fmt: skip


class LearnedDrafter:
    """What a trained drafter answers like every other: it fits a target of its `target_sizes` (the hidden size it
    reads, the vocabulary it proposes in), takes any tree as it is and remembers nothing while decoding."""

    target_sizes: tuple[int, int]

    def check_fits(self, target) -> None:
        check_fits(*self.target_sizes, target)

    def adapt_tree(self, spec: TreeSpec) -> TreeSpec:
        return spec

    def remember(self, tokens: list[int]) -> None:
        pass  # it learns in training only
