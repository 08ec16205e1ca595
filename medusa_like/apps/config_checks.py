"""What the Hydra apps share around their `main`: config values checked as soon as the config is composed, the run
directory checked before Hydra writes into it, and the resolvers the configs use.

    def train(cfg):
        check_config(cfg, TRAIN_CHECKS)
        ...

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
    def main(cfg):
        with one_line_errors():            # medusa_like/errors.py
            train(cfg)

A bad config value is a `ConfigError` (a `ValueError`: one `error:` line). A run directory that cannot be created
(`hydra.run.dir` on a read-only file system) fails the same way, before the run starts: `RunDirectoryCheck`, a Hydra
callback that `conf/hydra/default.yaml` installs for every entry point.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

from medusa_like.data.generation import check_engine
from medusa_like.data.naming import source_name
from medusa_like.errors import one_line_errors
from medusa_like.evaluation.precision import check_setting as check_fp32_reference
from medusa_like.forward import check_read_kernel
from medusa_like.targets import floating_dtype
from medusa_like.training.ttt import loss_function


class ConfigError(ValueError):
    """A config value of the wrong type or out of range: the message names the key, the value and what was expected."""


@dataclass(frozen=True)
class Check:
    """A config value's check; with `when=(key, value)`, applied only in configs whose `key` has that value, with
    `unless=(key, value)` only in the others, with `if_present` only in configs that have the key (a setting of some
    drafter kinds' configs alone). Elsewhere a checked key the config lacks is an error."""

    when: tuple[str, str] | None = field(default=None, kw_only=True)
    unless: tuple[str, str] | None = field(default=None, kw_only=True)
    if_present: bool = field(default=False, kw_only=True)

    def check(self, key: str, value) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Flag(Check):
    """A true/false config value (`overwrite=yes` would otherwise pass as a truthy string)."""

    def check(self, key: str, value) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key}: expected true or false, got {value!r}")


@dataclass(frozen=True)
class FloatDtype(Check):
    """The name of a torch floating-point dtype (float32, bfloat16, ...), or null when `optional`."""

    optional: bool = False
    words: tuple[str, ...] = ()  # other names accepted too (GGUF's f32, f16, q8_0)

    def check(self, key: str, value) -> None:
        if (value is None and self.optional) or (isinstance(value, str) and value in self.words):
            return
        if not isinstance(value, str) or floating_dtype(value) is None:
            expected = "a torch floating-point dtype name such as float32 or bfloat16" + (" or null" * self.optional)
            expected += f" (or one of {list(self.words)})" if self.words else ""
            raise ConfigError(f"config key {key}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class Number(Check):
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


@dataclass(frozen=True)
class Names(Check):
    """A non-empty list of names (`eval.methods=[a,b]`), or null: a bare string would be read letter by letter."""

    def check(self, key: str, value) -> None:
        if value is None:
            return
        if not isinstance(value, (list, tuple, ListConfig)) or not value or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f"config key {key}: expected a non-empty list of names ({key}=[a,b]) or null, got {value!r}"
            )


@dataclass(frozen=True)
class Accepted(Check):
    """A value that `accept` (the function that uses it) takes: its ValueError (or TypeError, for a value of another
    shape), naming what it expects, becomes the key's error, so the rule has one home and is still checked before any
    work."""

    accept: Callable[[object], object]

    def check(self, key: str, value) -> None:
        try:
            self.accept(value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"config key {key}: {err}") from None


@dataclass(frozen=True)
class NumberOrWord(Number):
    """A `Number`, or one of `words` (e.g. "auto")."""

    words: tuple[str, ...] = ()

    def check(self, key: str, value) -> None:
        if isinstance(value, str) and value in self.words:
            return
        try:
            super().check(key, value)
        except ConfigError as err:
            raise ConfigError(f"{err} (or one of {list(self.words)})") from None


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
    "distill.batch_size": Number(min=1),
    "distill.engine": Accepted(check_engine),
    # settings that some drafter kinds' configs (conf/drafter/<kind>.yaml) have and others lack
    "drafter.heads.num_heads": Number(min=1, if_present=True),
    "drafter.draft_vocab_size": Number(min=1, if_present=True),
    "drafter.module.ttt_steps": Number(min=1, if_present=True),
    "drafter.module.loss": Accepted(loss_function, if_present=True),
    "target_read_kernel": Accepted(check_read_kernel),
    **_DATA_CHECKS,
}
DISTILL_CHECKS = {
    "seed": Number(),
    "distill.batch_size": Number(min=1),
    "distill.engine": Accepted(check_engine),
    "distill.shard": Number(min=0),
    "distill.num_shards": Number(min=1),
    "distill.max_chunks": Number(min=1, optional=True),
    **_DATA_CHECKS,
}
EVAL_CHECKS = {
    "seed": Number(),
    "eval.max_new_tokens": Number(min=1),
    "eval.batch_size": Number(min=1),
    "eval.methods": Names(),
    "eval.prompt_lookup_num_tokens": NumberOrWord(min=1, words=("auto",)),
    "model.dtype": FloatDtype(optional=True),
    "drafter.dtype": FloatDtype(optional=True, words=("auto",)),
    "eval.k_max": Number(min=1),
    "eval.warmup": Flag(),
    "eval.head_accuracy": Flag(),
    "eval.fail_on_mismatch": Flag(),
    "eval.fp32_reference": Accepted(check_fp32_reference),
    "eval.resume": Flag(),
    "eval.threads": Number(min=1, optional=True),
    "drafter.num_heads": Number(min=1),
    "drafter.draft_vocab_size": Number(min=1, optional=True),
    "drafter.store_tokens": Number(min=1),
    "drafter.seed_store": Number(min=0),
    "data.skip": Number(min=0),
    "data.limit": Number(min=1, optional=True),
    "data.per_category": Number(min=1, optional=True),
    "data.max_turns": Number(min=1),
    "tree_search.timing_prompts": Number(min=1),
    "tree_search.calibration.limit": Number(min=1, optional=True),
}


_ABSENT = object()


def applies(check: Check, cfg: DictConfig) -> bool:
    """Whether `check` applies to `cfg`: its `when` holds and its `unless` does not (a check defined outside this
    module may lack either)."""
    when, unless = getattr(check, "when", None), getattr(check, "unless", None)
    if when is not None and OmegaConf.select(cfg, when[0]) != when[1]:
        return False
    return unless is None or OmegaConf.select(cfg, unless[0]) != unless[1]


def check_config(cfg: DictConfig, checks: dict[str, Check | tuple[Check, ...]]) -> None:
    """Raise `ConfigError` for the first key of `checks` whose value does not pass its check (or its checks: a tuple,
    each with its own `when` or `unless`), or that `cfg` lacks (a typo in the checks, or a key the config no longer
    has, is refused rather than skipped). First, a key the config marks required (`???`) and the command left unset
    is named, before anything is loaded."""
    container = OmegaConf.to_container(cfg, resolve=False)  # unresolved: nothing is evaluated yet
    container.pop("hydra", None)  # Hydra's own node (where a test composes it in), which Hydra fills as it runs
    missing = unset_keys(container)
    if missing:
        given = " ".join(f"{key}=..." for key in missing)
        many = len(missing) > 1
        raise ConfigError(
            f"config key{'s' * many} {', '.join(missing)} {'are' if many else 'is'} required: give {given}"
        )
    for key, key_checks in checks.items():
        for check in key_checks if isinstance(key_checks, tuple) else (key_checks,):
            if not applies(check, cfg):
                continue
            value = OmegaConf.select(cfg, key, default=_ABSENT)
            if value is _ABSENT and getattr(check, "if_present", False):
                continue
            if value is _ABSENT:
                when = getattr(check, "when", None)
                scope = f" (checked where {when[0]}={when[1]})" if when else ""
                raise ConfigError(f"config key {key}{scope}: checked, but the config has no such key")
            check.check(key, value)


def unset_keys(node, prefix: str = "") -> list[str]:
    """The dotted keys of a config's plain container (`OmegaConf.to_container`, unresolved) still marked `???`."""
    if isinstance(node, (dict, list)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        return [found for key, value in items for found in unset_keys(value, f"{prefix}{key}.")]
    return [prefix[:-1]] if node == "???" else []


class RunDirectoryCheck(Callback):
    """Creates the run directory before Hydra does, so that one it cannot create or write to (a read-only file system
    or directory, a path through a file) ends the command with one `error:` line naming `hydra.run.dir` instead of
    Hydra's traceback."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._create(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._create(config, "hydra.sweep.dir")

    @staticmethod
    def _create(config: DictConfig, key: str) -> None:
        HydraConfig.instance().set_config(config)  # resolves ${hydra:...} in the directory, as Hydra's run_job does
        directory = Path(str(OmegaConf.select(config, key)))
        with one_line_errors():
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise OSError(f"cannot create the run directory {key}={directory}: {err}") from err
            if not os.access(directory, os.W_OK | os.X_OK):
                raise PermissionError(f"the run directory {key}={directory} exists and cannot be written to")


def computes_in_bf16() -> bool:
    """Whether this machine runs bf16 matrix products natively: a CUDA GPU, or a CPU with AVX512-BF16 (or AMX).
    Elsewhere (AVX2-only CPUs) torch emulates bf16, several times slower than fp32."""
    cpu = torch.cpu
    native = any(
        getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )
    return torch.cuda.is_available() or native


def register_resolvers() -> None:
    """`${source_name:...}` (a local data source's directory name); `${fast_dtype:}` and `${fast_precision:}`:
    bfloat16 / bf16-mixed where the machine computes in bf16 natively, else float32 / 32-true; `${if_bf16:a,b}`: a
    there, else b (e.g. a longer training budget where steps are cheaper)."""
    resolvers = {
        "source_name": source_name,
        "if_bf16": lambda native, emulated: native if computes_in_bf16() else emulated,
        "fast_dtype": lambda: "bfloat16" if computes_in_bf16() else "float32",
        "fast_precision": lambda: "bf16-mixed" if computes_in_bf16() else "32-true",
    }
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


register_resolvers()
