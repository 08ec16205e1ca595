"""The drafter's Lightning module from a composed training config (`cfg.drafter` and the shared `cfg.module`)."""

from hydra.utils import instantiate
from omegaconf import DictConfig

from medusa_like.drafters.registry import kind_named


def build_module(cfg: DictConfig, target):
    """The Lightning module of the drafter kind `cfg.drafter.kind` for `target`, with the shared `cfg.module` settings."""
    shared = dict(
        target_name=cfg.model.name_or_path,
        optimizer=instantiate(cfg.module.optimizer),
        scheduler=instantiate(cfg.module.scheduler) if cfg.module.get("scheduler") else None,
        hidden_cache_dir=cfg.module.get("hidden_cache_dir"),
    )
    kind = kind_named(cfg.drafter.kind)
    if not kind.trainable:
        raise ValueError(f"drafter.kind={kind.name} needs no training; train drafter=eagle3 or drafter=medusa")
    return kind.training_module(cfg, target, **shared)
