"""What the Hydra entry points share around their `main`: config values checked as soon as the config is composed,
one-line errors for expected failures, and the resolvers the configs use.

    def train(cfg):
        check_config(cfg, TRAIN_CHECKS)
        ...

    @hydra.main(version_base="1.3", config_path="../conf", config_name="train")
    def main(cfg):
        with one_line_errors():
            train(cfg)

Expected failures (bad input: a missing file, a malformed dataset, a drafter for another target, a bad config value)
are `OSError`s and `ValueError`s; they end the command with `error: <message>` on one line and exit status 1. Any other
exception is a bug and keeps its traceback. `HYDRA_FULL_ERROR=1` shows the full traceback for every error.
"""

import contextlib
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

EXPECTED_ERRORS = (OSError, ValueError)


class ConfigError(ValueError):
    """A config value of the wrong type or out of range: the message names the key, the value and what was expected."""


@dataclass(frozen=True)
class Number:
    """An int (or float) config value, at least `min`, or null when `optional`."""

    kind: type = int
    min: float | None = None
    optional: bool = False

    def check(self, key: str, value) -> None:
        if value is None and self.optional:
            return
        is_int = isinstance(value, int) and not isinstance(value, bool)
        fits = is_int or (self.kind is float and isinstance(value, float))
        if not fits or (self.min is not None and value < self.min):
            expected = "an integer" if self.kind is int else "a number"
            expected += f" >= {self.min}" if self.min is not None else ""
            expected += " or null" if self.optional else ""
            raise ConfigError(f"config key {key}: expected {expected}, got {value!r}")


_DATA_CHECKS = {
    "data.num_conversations": Number(min=1, optional=True),
    "data.chunk_size": Number(min=1),
    "data.val_fraction": Number(float, min=0.0),
    "data.generation.max_new_tokens": Number(min=1),
    "data.generation.max_prompt_tokens": Number(min=1),
    "data.generation.max_length": Number(min=2),
    "data.module.batch_size": Number(min=1),
}
TRAIN_CHECKS = {
    "seed": Number(),
    "trainer.max_epochs": Number(min=-1, optional=True),
    "trainer.max_steps": Number(min=-1),
    "trainer.accumulate_grad_batches": Number(min=1),
    "trainer.gradient_clip_val": Number(float, min=0.0, optional=True),
    "trainer.log_every_n_steps": Number(min=1),
    "module.optimizer.lr": Number(float, min=0.0),
    "drafter.num_heads": Number(min=1),
    "drafter.draft_vocab_size": Number(min=1),
    "drafter.module.ttt_steps": Number(min=1),
    **_DATA_CHECKS,
}
DISTILL_CHECKS = {
    "seed": Number(),
    "distill.batch_size": Number(min=1),
    "distill.num_shards": Number(min=1),
    **_DATA_CHECKS,
}
EVAL_CHECKS = {
    "seed": Number(),
    "eval.max_new_tokens": Number(min=1),
    "eval.prompt_lookup_num_tokens": Number(min=1),
    "eval.k_max": Number(min=1),
    "eval.threads": Number(min=1, optional=True),
    "drafter.num_heads": Number(min=1),
    "drafter.draft_vocab_size": Number(min=1, optional=True),
    "data.skip": Number(min=0),
    "data.limit": Number(min=1, optional=True),
    "data.per_category": Number(min=1, optional=True),
    "data.max_turns": Number(min=1),
    "tree_search.timing_prompts": Number(min=1),
    "tree_search.calibration.limit": Number(min=1, optional=True),
}


def check_config(cfg: DictConfig, checks: dict[str, Number]) -> None:
    """Raise `ConfigError` for the first key of `checks` present in `cfg` whose value does not pass its check."""
    for key, check in checks.items():
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig) and leaf in node:
            check.check(key, OmegaConf.select(cfg, key))


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Around an entry point's work: an expected failure ends the command with `error: <message>` and status 1."""
    try:
        yield
    except EXPECTED_ERRORS as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.debug("expected failure", exc_info=err)
        print(f"error: {err}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        sys.exit(1)


def source_name(source: str) -> str:
    """A data directory name for a conversation source: a file or directory gets its stem and a hash of its absolute
    path, so that different sources never share a directory; a name ('sharegpt', a hub dataset) is kept."""
    path = Path(str(source))
    if not path.exists():
        return str(source).replace("/", "--")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    return f"{path.stem}-{digest}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("source_name"):
        OmegaConf.register_new_resolver("source_name", source_name)


register_resolvers()
