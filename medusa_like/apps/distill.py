"""Build a training dataset with the target: self-distilled answers, or the conversations' own text.

    medusa-distill                                              # the default experiment's data
    medusa-distill experiment=smollm2_medusa_full distill.shard=0 distill.num_shards=4

Running the same command again resumes; the last shard to finish combines all chunks into ${data.dir}/dataset.
`distill(cfg)` is importable; `main` is the Hydra app behind `medusa-distill` and `python -m train.distill`.
"""

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig

from medusa_like.apps import CONFIG_DIR
from medusa_like.apps.config_checks import DISTILL_CHECKS, check_config
from medusa_like.data.prepare import build_dataset, load_model
from medusa_like.errors import one_line_errors
from medusa_like.runs import resolved, save_config

log = logging.getLogger(__name__)


def distill(cfg: DictConfig) -> Path | None:
    """Build this shard's chunks; returns the combined dataset's path once every shard is done, else None."""
    check_config(cfg, DISTILL_CHECKS)
    save_config(resolved(cfg), Path(cfg.paths.output_dir))
    target, tokenizer = load_model(cfg.model)
    path = build_dataset(
        cfg, target, tokenizer, cfg.distill.shard, cfg.distill.num_shards, cfg.distill.get("max_chunks")
    )
    if path is None:
        log.info("shard %d/%d done; other shards' chunks are still missing", cfg.distill.shard, cfg.distill.num_shards)
    return path


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="distill")
def main(cfg: DictConfig) -> None:
    with one_line_errors():
        distill(cfg)
