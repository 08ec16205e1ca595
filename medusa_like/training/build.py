"""The drafter's Lightning module from a composed training config (`cfg.drafter` and the shared `cfg.module`), and
each trainable kind's builder of it (named by the kind, `drafters/kinds.py`)."""

from hydra.utils import instantiate
from omegaconf import DictConfig

from medusa_like.data.split import draft_vocab_from_training_split
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


def eagle3_training_module(cfg: DictConfig, target, **shared):
    """The Lightning module of `cfg.drafter` (conf/drafter/eagle3.yaml), its draft vocabulary counted on the training
    split of `cfg.data`."""
    vocab_size = target.config.get_text_config().vocab_size
    data = cfg.data
    vocab = draft_vocab_from_training_split(
        data.dir, int(cfg.drafter.draft_vocab_size), vocab_size, data.val_fraction, data.split_seed
    )
    return instantiate(cfg.drafter.module, vocab=vocab, target=target, **shared, _convert_="object")


def heads_training_module(cfg: DictConfig, target, **shared):
    """The Lightning module of `cfg.drafter` (conf/drafter/medusa.yaml) for `target`."""
    lm_head = target.get_output_embeddings().weight
    heads = instantiate(cfg.drafter.heads, vocab_size=lm_head.shape[0], hidden_size=lm_head.shape[1])
    return instantiate(cfg.drafter.module, heads_config=heads, target=target, **shared, _convert_="object")
