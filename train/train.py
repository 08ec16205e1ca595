"""Train Medusa heads on a frozen target with Lightning (Hydra app); exports them to <run dir>/heads at the end.

    python -m train.train experiment=smollm2_medusa                 # the default experiment (distils first if needed)
    python -m train.train model=tiny_llama data=tiny debug=fdr      # a fast dev run on a tiny random model
    python -m train.train trainer=ddp trainer.devices=8 ckpt_path=runs/train/<run>/checkpoints/last.ckpt

`train(cfg)` is importable, so tests and notebooks run it on a composed config.
"""

import json
import logging
from pathlib import Path

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from medusa_like import distill as distill_lib
from train.distill import distil_dataset, load_model
from train.run_dir import resolved, save_config

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, float]:
    """Distil if needed, fit, export; returns the final metrics (also written to <run dir>/metrics.json)."""
    L.seed_everything(cfg.seed, workers=True)
    run_config = resolved(cfg)
    save_config(run_config, Path(cfg.paths.output_dir))
    target, tokenizer = load_model(cfg.model)
    if distill_lib.is_complete(cfg.data.dir):
        gen = distill_lib.GenerationConfig(**OmegaConf.to_container(cfg.data.generation, resolve=True))
        distill_lib.check_finished_recipe(cfg.data.dir, gen, cfg.data.num_conversations)
    else:
        if not cfg.distill_if_missing:
            distill_lib.load_distilled(cfg.data.dir)  # raises with the command to run
        distil_dataset(cfg, target, tokenizer)
    datamodule = instantiate(cfg.data.module)
    lm_head = target.get_output_embeddings().weight
    heads_config = instantiate(cfg.heads, vocab_size=lm_head.shape[0], hidden_size=lm_head.shape[1])
    module = instantiate(
        cfg.module, target=target, heads_config=heads_config, target_name=cfg.model.name_or_path, _convert_="object"
    )
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    for logger in trainer.loggers:
        logger.log_hyperparams(run_config)

    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    out_dir = Path(cfg.paths.output_dir)
    if trainer.is_global_zero:
        out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.get("export_heads"):
            from medusa_like.export import save_heads

            heads_dir = save_heads(module.heads, out_dir / "heads", target, cfg.model.name_or_path)
            log.info("heads exported to %s", heads_dir)
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
        log.info("validation: %s", {k: round(v, 4) for k, v in sorted(metrics.items()) if k.startswith("val/acc")})
    _finish_wandb()
    return metrics


def _finish_wandb() -> None:
    """Close the W&B run so its offline directory is complete before the process (or the next test) goes on."""
    import sys

    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
