"""The drafter's Lightning module from a composed training config: the kind `cfg.drafter.kind` (a registered kind
that has weights), trained by the `DrafterModule` class its config names (`cfg.drafter.module._target_`, in
conf/drafter/<kind>.yaml), which builds itself with `from_config` from `cfg.drafter` and the shared `cfg.module`."""

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

from medusa_like.drafters.registry import kind_named, trainable_kinds
from medusa_like.training.drafter_module import DrafterModule


def module_class(cfg: DictConfig) -> type[DrafterModule]:
    """The Lightning module class that trains `cfg.drafter.kind`, as `cfg.drafter.module._target_` names it; refuses a
    kind with nothing to train, and a class that trains another kind."""
    kind = kind_named(cfg.drafter.kind)
    if not kind.trainable:
        raise ValueError(
            f"drafter.kind={kind.name} needs no training; train one of {trainable_kinds()} (drafter=<kind>)"
        )
    target = cfg.drafter.get("module", {}).get("_target_")
    try:
        found = get_class(target) if target else None
    except (ImportError, ValueError) as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"drafter.module._target_={target!r} names no importable class: {reason}") from err
    if not (isinstance(found, type) and issubclass(found, DrafterModule) and found.kind == kind.name):
        trains = getattr(found, "kind", None)
        raise ValueError(
            f"drafter.module._target_={target!r} (trains {trains!r}) does not train drafter.kind={kind.name}: expected "
            f"a training.drafter_module.DrafterModule whose kind is {kind.name!r}"
        )
    return found


def build_module(cfg: DictConfig, target) -> DrafterModule:
    """The Lightning module of the drafter kind `cfg.drafter.kind` for `target`, with the shared `cfg.module` settings."""
    module = module_class(cfg)
    shared = dict(
        target_name=cfg.model.name_or_path,
        optimizer=instantiate(cfg.module.optimizer),
        scheduler=instantiate(cfg.module.scheduler) if cfg.module.get("scheduler") else None,
    )
    return module.from_config(cfg, target, **shared)
