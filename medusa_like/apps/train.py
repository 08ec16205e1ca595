"""Train a drafter on a frozen target with Lightning; exports it to <run dir>/drafter at the end.

    medusa-train experiment=smollm2_eagle3                   # the default experiment (builds its data first)
    medusa-train model=tiny_llama data=tiny debug=fdr        # a fast dev run on a tiny random model

`train(cfg)` is importable, so tests and notebooks run it on a composed config; `main` is the Hydra app behind
`medusa-train` and the checkout's `python -m train.train`.
"""

import logging
import sys
from pathlib import Path

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

from medusa_like.apps import CONFIG_DIR
from medusa_like.apps.config_checks import TRAIN_CHECKS, check_config
from medusa_like.data.prepare import ensure_dataset, load_model
from medusa_like.errors import one_line_errors
from medusa_like.formats import save_drafter
from medusa_like.forward import use_read_kernel
from medusa_like.io import read_training_checkpoint, write_json
from medusa_like.runs import resolved, save_config
from medusa_like.training.build import build_module
from medusa_like.training.resume import (
    check_left_to_train,
    check_resume,
    check_trained,
    checkpoint_step,
    config_settings,
    loaded_settings,
    record_resume,
    resume_checkpoint,
)

log = logging.getLogger(__name__)


def instantiate_all(group: DictConfig | None) -> list:
    """The objects of a callbacks/logger group; entries without `_target_` (an experiment's settings for a logger
    that was switched off, say) or set to null (`callbacks.progress_bar=null`) are left out."""
    return [instantiate(c) for c in (group or {}).values() if c is not None and "_target_" in c]


def train(cfg: DictConfig) -> dict[str, float]:
    """Build the data if needed, fit, export; returns the final metrics (also written to <run dir>/metrics.json).
    A resumed run (`ckpt_path`) is checked against its checkpoint's settings first (`training/resume.py`). The W&B
    run is closed however it ends, so that a run that raised leaves none open for the next one in this process."""
    try:
        return _train(cfg)
    finally:
        _finish_wandb()


def _train(cfg: DictConfig) -> dict[str, float]:
    check_config(cfg, TRAIN_CHECKS)
    L.seed_everything(cfg.seed, workers=True)
    out_dir = Path(cfg.paths.output_dir)
    ckpt_path = resume_checkpoint(cfg.get("ckpt_path"), out_dir)
    check_resume(ckpt_path, config_settings(cfg))  # before anything is loaded
    run_config = resolved(cfg)
    if ckpt_path is None:
        save_config(run_config, out_dir)  # first, so that a run cut short (building its data, say) has it
    target, tokenizer = load_model(cfg.model)
    ensure_dataset(cfg, target, tokenizer)
    # seeded again: building the data samples the target's answers from the global generators, so without this the
    # drafter's initialisation and the data's order would depend on whether this run built its data or found it built
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data.module)
    module = build_module(cfg, target)
    module.resume_settings = config_settings(cfg) | loaded_settings(module, cfg)
    applied = check_resume(ckpt_path, module.resume_settings, complete=True)
    check_left_to_train(ckpt_path, cfg.trainer)  # a resume at its limits: refused before anything is written
    if ckpt_path is not None:
        save_config(run_config, out_dir)  # a resumed run's settings, once its checkpoint accepted them
    callbacks = instantiate_all(cfg.get("callbacks"))
    loggers = instantiate_all(cfg.get("logger"))
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    # the decoder's products (the head keeps F.linear), on the device the trainer moves the target to
    if use_read_kernel(target.base_model, cfg.target_read_kernel, device=trainer.strategy.root_device):
        log.info("the frozen target's layers read the training rows on this CPU's packed weights (target_read_kernel)")
    for logger in trainer.loggers:
        logger.log_hyperparams(run_config)
    if applied and trainer.is_global_zero:  # settings changed on resuming: when, and from what
        record_resume(out_dir, ckpt_path, applied)

    start_step = checkpoint_step(ckpt_path) if ckpt_path is not None else None
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    check_trained(ckpt_path, start_step, trainer)  # a resume that trained nothing stops here

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    best = restore_best(trainer, module)
    if best is not None:
        metrics.update(best)
    if trainer.is_global_zero:
        if cfg.get("export_drafter"):
            # a resumed run replaces the export of the run it continues (an export it made before training further)
            resumed = ckpt_path is not None
            path = save_drafter(module.drafter, out_dir / "drafter", target, cfg.model.name_or_path, overwrite=resumed)
            log.info("drafter exported to %s", path)
        write_json(out_dir / "metrics.json", dict(sorted(metrics.items())))
        log.info("validation: %s", {k: round(v, 4) for k, v in sorted(metrics.items()) if k.startswith("val/acc")})
    return metrics


def restore_best(trainer: L.Trainer, module) -> dict[str, float] | None:
    """Load the weights of the best checkpoint by the drafter's monitored metric (`drafter.monitor`) into `module`,
    so that the exported drafter is the best one rather than the last; returns {"best/<metric>": score, ...}, or None
    when no checkpoint was chosen (no checkpoint callback, or nothing validated)."""
    callback = trainer.checkpoint_callback
    path = getattr(callback, "best_model_path", "") if callback is not None else ""
    if not path or callback.best_model_score is None:
        return None
    checkpoint = read_training_checkpoint(path, ("state_dict", "global_step"), trusted=True)
    module.load_state_dict(checkpoint["state_dict"])
    log.info("exporting the best checkpoint by %s (%.4f): %s", callback.monitor, callback.best_model_score, path)
    return {f"best/{callback.monitor}": float(callback.best_model_score), "best/step": float(checkpoint["global_step"])}


def _finish_wandb() -> None:
    """Close the W&B run so its offline directory is complete before the process (or the next test) goes on: `finish`
    can return before W&B's service process has written the run's records, so the service is shut down too (the next
    run starts one)."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()
        wandb.teardown()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def main(cfg: DictConfig) -> None:
    with one_line_errors():
        train(cfg)
