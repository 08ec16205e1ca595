"""Self-distil a conversation set with the target (Hydra app).

    python -m train.distill                                    # the default experiment's data (sharegpt_small)
    python -m train.distill experiment=smollm2_medusa_full distill.shard=0 distill.num_shards=4
    python -m train.distill data=local data.source=my_chats.jsonl data.generation.temperature=0

Running the same command again resumes; the last shard to finish combines all chunks into ${data.dir}/dataset.
"""

import logging
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from medusa_like import distill as distill_lib
from train.run_dir import resolved, save_config

log = logging.getLogger(__name__)


def load_model(model_cfg: DictConfig, **overrides):
    """(frozen target, tokenizer) from a `model/` config, with the config's chat template if it sets one.

    `overrides` replace arguments of the config's loader (e.g. dtype=...)."""
    target, tokenizer = instantiate(model_cfg.loader, **overrides)
    if model_cfg.get("chat_template"):
        tokenizer.chat_template = model_cfg.chat_template
    return target, tokenizer


def distil_dataset(cfg: DictConfig, target, tokenizer, shard: int = 0, num_shards: int = 1, max_chunks=None):
    """Distil (or resume distilling) the dataset `cfg.data` describes into `cfg.data.dir`."""
    gen = distill_lib.GenerationConfig(**OmegaConf.to_container(cfg.data.generation, resolve=True))
    conversations = distill_lib.select_conversations(
        cfg.data.source, cfg.data.num_conversations, tokenizer, gen, split=cfg.data.split
    )
    log.info("distilling %d conversations from %s into %s", len(conversations), cfg.data.source, cfg.data.dir)
    path = distill_lib.run(
        target,
        tokenizer,
        conversations,
        cfg.data.dir,
        gen,
        batch_size=cfg.distill.batch_size,
        chunk_size=cfg.data.chunk_size,
        shard=shard,
        num_shards=num_shards,
        max_chunks=max_chunks,
        target_name=cfg.model.name_or_path,
        progress=cfg.distill.progress,
    )
    if path is None:
        log.info("shard %d/%d done; other shards' chunks are still missing", shard, num_shards)
    else:
        log.info("dataset complete: %s (%d rows)", path, len(distill_lib.load_distilled(cfg.data.dir)))
    return path


def distill(cfg: DictConfig) -> Path | None:
    save_config(resolved(cfg), Path(cfg.paths.output_dir))
    target, tokenizer = load_model(cfg.model)
    return distil_dataset(
        cfg, target, tokenizer, cfg.distill.shard, cfg.distill.num_shards, cfg.distill.get("max_chunks")
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="distill")
def main(cfg: DictConfig) -> None:
    distill(cfg)


if __name__ == "__main__":
    main()
