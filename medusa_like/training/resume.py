"""Resuming a training run: which checkpoint `ckpt_path` names, and whether this run's settings may continue it.

    path = resume_checkpoint(cfg.ckpt_path, out_dir)         # None for a fresh run; `last`: this run directory's only
    check_resume(path, config_settings(cfg))                 # before anything is loaded
    module.resume_settings = settings = config_settings(cfg) | loaded_settings(module, cfg)
    applied = check_resume(path, settings, complete=True)    # {key: (checkpoint's, run's)} put to use from here on
    check_left_to_train(path, cfg.trainer)                   # a resume at its limits: refused before anything is written

Every checkpoint records the settings it was trained with (`RESUME_KEY`, flat dotted keys). A resumed run compares its
own with them before any step, and for each setting that differs:

- refuses, naming every such key with both values, when the change would make the resumed steps another training:
  the drafter (kind, architecture, draft vocabulary), the target (its weights and dtype), the objective (the
  drafter's loss settings: loss, unrolled steps, decay, top-k, labelled positions, vocabulary check, KL), the data
  (directory, its recipe, split, batch size, longest row, echo, seed, gradient accumulation, devices) and the
  optimizer's or schedule's kind;
- applies, and records in the run directory's `resumes.json`, the settings whose change has one meaning from the
  checkpoint's step on: the optimizer's hyperparameters (`module.optimizer.lr` becomes the schedule's new peak: the
  step's rate is the new peak times the schedule's factor at that step), the schedule's shape (`module.scheduler.*`)
  and the run's length (`trainer.max_epochs`, `max_steps`, `max_time`: the schedule is fitted to the new length);
- ignores how the drafter started (its weights come from the checkpoint), where the target cache lives, and how the
  run is carried out or logged (precision, validation, logging, callbacks).

A checkpoint without recorded settings (written before they were) is checked for its drafter kind only, with a
warning. A resumed run
whose checkpoint already reached its limits stops with one error line before it writes anything
(`check_left_to_train`; `check_trained` after the fit is the backstop).
"""

import functools
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from lightning.pytorch.callbacks import Timer
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.optim.lr_scheduler import LambdaLR

from medusa_like.drafters.base import CHECKPOINT_KEY
from medusa_like.errors import one_line_errors
from medusa_like.io import read_training_checkpoint, write_json
from medusa_like.runs import config_values, flatten
from medusa_like.training.target_cache import vocab_digest

log = logging.getLogger(__name__)

RESUME_KEY = "medusa_like_resume"  # a checkpoint's recorded settings
LAST = "last"  # ckpt_path=last: this run directory's checkpoints/last.ckpt
RECORD = "resumes.json"  # in the run directory: each resume's checkpoint, step and applied changes

# config sections recorded, as flat dotted keys
SECTIONS = (
    "drafter.kind",
    "drafter.draft_vocab_size",
    "drafter.heads",
    "drafter.module",
    "data.dir",
    "data.module",
    "seed",
    "trainer.accumulate_grad_batches",
    "trainer.devices",
    "trainer.num_nodes",
    "module.optimizer",
    "module.scheduler",
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.max_time",
)
# changes that a resumed run puts to use from the checkpoint's step on (everything else recorded is refused)
APPLIED = ("module.optimizer.", "module.scheduler.", "trainer.max_epochs", "trainer.max_steps", "trainer.max_time")
APPLIED_EXCEPT = ("module.optimizer._target_", "module.scheduler._target_")  # another optimizer or schedule kind
# not compared: how the drafter started (a resume loads its weights), where the cache lives, how the loader runs
IGNORED = (
    "drafter.module.init_from_target",
    "drafter.module.init_layer_from_target",
    "drafter.module.init_embedding_from_feature",
    "drafter.module.target_cache_dir",
    "drafter.module.target_cache_batch_tokens",
    "data.module._target_",
    "data.module.dataset_dir",  # data.dir
    "data.module.num_workers",
)


class TrainingResumeError(ValueError):
    """A resume whose settings differ from its checkpoint's where a resumed run cannot change them."""


def resume_checkpoint(ckpt_path: str | None, out_dir: Path) -> str | None:
    """The checkpoint a run resumes from: None, a .ckpt file, or for `last` this run directory's
    `checkpoints/last.ckpt`, never another run's (a sibling run may train another drafter, or be another experiment
    that happens to fit)."""
    if ckpt_path is None:
        held = [name for name in ("checkpoints/last.ckpt", "drafter") if (Path(out_dir) / name).exists()]
        if held:  # a fresh run here would overwrite them (a forgotten ckpt_path=last after a kill, say)
            raise FileExistsError(
                f"{out_dir} already holds a run ({', '.join(held)}): resume it with ckpt_path=last, or train in "
                "another hydra.run.dir (or delete this one)"
            )
        return None
    if ckpt_path != LAST:
        if not Path(ckpt_path).is_file():
            raise FileNotFoundError(f"ckpt_path={ckpt_path!r} does not exist (a .ckpt file, or 'last')")
        return ckpt_path
    out_dir = Path(out_dir)
    last = out_dir / "checkpoints" / "last.ckpt"
    if last.is_file():
        return str(last)
    others = sorted(out_dir.parent.glob("*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    hint = (
        f"; other runs' checkpoints, e.g. {others[0]}: resume one with hydra.run.dir=<its run directory> "
        "ckpt_path=last, or ckpt_path=<its .ckpt>"
        if others
        else "; start without ckpt_path, or pass hydra.run.dir=<the directory of the run to resume>"
    )
    raise FileNotFoundError(
        f"ckpt_path=last resumes this run's own directory only, and {out_dir} holds no checkpoints/last.ckpt{hint}"
    )


class ResumeCheck(Callback):
    """The training app's Hydra callback: what a run can check from its command line alone (`resume_checkpoint`, and
    `check_resume` on the config's settings) is checked before Hydra writes its `.hydra/` files and log into the run
    directory, so that a refused run leaves the run it would have overwritten or continued as it found it. The app
    checks again (a `train(cfg)` call has no Hydra), and completes the check once the target is loaded."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # resolves ${hydra:...}, as Hydra's run_job does
        with one_line_errors():
            path = resume_checkpoint(config.get("ckpt_path"), Path(str(config.hydra.run.dir)))
            try:
                settings = config_settings(config)
            except OmegaConfBaseException:  # a value known only once the job runs: the app checks it then
                return
            check_resume(path, settings)


def config_settings(cfg: DictConfig) -> dict:
    """The recorded settings that `cfg` alone gives (known before the target is loaded)."""
    return {k: v for k, v in config_values(cfg, SECTIONS).items() if not k.startswith(IGNORED)}


def loaded_settings(module, cfg: DictConfig) -> dict:
    """The recorded settings known once the target is loaded and the drafter built: the target's weights and dtype,
    the drafter's config and draft vocabulary, and the data directory's recipe (what its rows were made from)."""
    meta = dict(module.drafter_meta())
    token_ids = meta.pop("draft_token_ids", None)
    recipe = Path(str(cfg.data.dir)) / "recipe.json"
    return {
        "target weights": module.target_weights,
        "target dtype": str(module.target.dtype),
        "draft vocabulary": None if token_ids is None else vocab_digest(torch.as_tensor(token_ids)),
        **flatten(meta, "drafter config"),
        **flatten(json.loads(recipe.read_text(encoding="utf-8")) if recipe.is_file() else None, "data recipe"),
    }


def is_applied(key: str) -> bool:
    return key.startswith(APPLIED) and key not in APPLIED_EXCEPT


def check_resume(path: str | None, settings: dict, complete: bool = False) -> dict[str, tuple]:
    """Before a run continues the checkpoint at `path` (nothing for None): {key: (the checkpoint's value, this
    run's)} of the settings that differ and are applied; raises `TrainingResumeError` naming every refused one. Only
    the keys of `settings` are compared, and with `complete` the checkpoint's other keys too."""
    if path is None:
        return {}
    checkpoint = read_checkpoint(path)
    kind = checkpoint.get(CHECKPOINT_KEY, {}).get("kind")
    recorded = checkpoint.get(RESUME_KEY)
    if recorded is None:
        if "drafter.kind" in settings and kind not in (None, settings["drafter.kind"]):
            recorded = {"drafter.kind": kind}  # a checkpoint of before the settings were recorded: its kind
        else:
            if complete:
                log.warning("ckpt_path=%s records no training settings (written before they were): resumed without "
                            "checking them", path)  # fmt: skip
            return {}
    keys = [*settings, *(k for k in recorded if k not in settings and complete)]
    differing = [k for k in keys if k in recorded and (k not in settings or recorded[k] != settings[k])]
    differing += [k for k in keys if k not in recorded and complete and settings.get(k) is not None]
    refused = [k for k in differing if not is_applied(k)]
    if refused:
        listed = "; ".join(f"{k}: {show(recorded, k)} in the checkpoint, {show(settings, k)} now" for k in refused)
        raise TrainingResumeError(
            f"ckpt_path={path} was trained with other settings, which a resumed run cannot change: {listed}. Resume "
            "with the checkpoint's settings, or start a new run (without ckpt_path)"
        )
    return {k: (recorded.get(k), settings.get(k)) for k in differing}


def show(settings: dict, key: str) -> str:
    return repr(settings[key]) if key in settings else "not set"


def read_checkpoint(path: str) -> dict:
    """The Lightning checkpoint a run resumes (`ckpt_path`, which Lightning unpickles fully in any case), named as
    `ckpt_path` in its errors."""
    return read_training_checkpoint(path, ("global_step", "state_dict"), name=f"ckpt_path={path}", trusted=True)


def checkpoint_step(path: str) -> int:
    """The optimizer steps the checkpoint at `path` had trained."""
    return int(read_checkpoint(path)["global_step"])


def record_resume(out_dir: Path, path: str, applied: dict[str, tuple]) -> None:
    """Append this resume (its checkpoint, step and applied changes) to the run directory's `resumes.json`, and log
    each applied change: the run's config.yaml holds the settings in force now, this file when they changed."""
    step = checkpoint_step(path)
    for key, (before, now) in applied.items():
        log.info("resumed at step %d with %s=%r (the checkpoint's: %r), applied from here on", step, key, now, before)
    record = Path(out_dir) / RECORD
    earlier = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else []
    changes = {key: {"checkpoint": before, "run": now} for key, (before, now) in applied.items()}
    write_json(record, [*earlier, {"checkpoint": str(path), "step": step, "applied": changes}])


def apply_optimizer_settings(optimizer, scheduler, factory) -> None:
    """Put the run's optimizer hyperparameters (`factory`: the config's partial, e.g. AdamW's lr, betas, weight decay)
    in place of those restored from a checkpoint. With a schedule the learning rate is its peak: each parameter
    group's rate becomes the new peak times the schedule's factor at the restored step."""
    keywords = dict(factory.keywords) if isinstance(factory, functools.partial) else {}
    lr = keywords.pop("lr", None)
    for i, group in enumerate(optimizer.param_groups):
        for name, value in keywords.items():
            if name in group:
                group[name] = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else value
        if lr is None:
            continue
        if scheduler is None:
            group["lr"] = lr
        elif scheduler.base_lrs[i] != lr:
            if not isinstance(scheduler, LambdaLR):
                raise TrainingResumeError(
                    f"module.optimizer.lr={lr} differs from the checkpoint's {scheduler.base_lrs[i]}, and a "
                    f"{type(scheduler).__name__} cannot take a new peak: resume with the checkpoint's rate"
                )
            group["initial_lr"] = scheduler.base_lrs[i] = lr
            group["lr"] = lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
    if isinstance(scheduler, LambdaLR):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def finish_epoch_end_state(checkpoint: dict, max_steps: int) -> None:
    """Make a checkpoint saved at an epoch's end (`on_train_epoch_end`: the epoch processed, not yet counted complete)
    resume as Lightning resumes it without `max_steps`: the next epoch starts at its first batch, with a new data
    iterator. With `max_steps` set, Lightning takes every resume for a restart inside the epoch: it runs the finished
    epoch again with no batch left and counts it a second time, so that a resume given one more epoch trained none
    (Lightning 2.6). Changed in place, before the loops read it; any other checkpoint is left as it is."""
    loops = checkpoint.get("loops", {}).get("fit_loop")
    if max_steps == -1 or not loops:
        return
    epochs, batches = loops["epoch_progress"], loops["epoch_loop.batch_progress"]
    current = epochs["current"]
    if current["processed"] != current["completed"] + 1 or not batches.get("is_last_batch"):
        return
    for progress in (epochs["total"], current):
        progress["completed"] = progress["processed"]
    batches["current"] = dict.fromkeys(batches["current"], 0)
    batches["is_last_batch"] = False
    loops.get("state_dict", {}).pop("combined_loader", None)  # the finished epoch's iterator: the next starts anew


class NothingToTrainError(ValueError):
    """A resumed run whose checkpoint already reached the run's limits."""


def check_left_to_train(path: str | None, trainer_cfg) -> None:
    """Before a run resumes the checkpoint at `path`, and before it writes anything: refuse when the checkpoint has
    reached the run's limits already (steps, epochs, or the time budget, which Lightning's timer counts on from the
    checkpoint's), so that a resume with nothing left to train changes nothing in the run directory."""
    if path is None:
        return
    checkpoint = read_checkpoint(path)
    step, epochs = int(checkpoint["global_step"]), finished_epochs(checkpoint)
    max_steps, max_epochs = trainer_cfg.get("max_steps", -1), trainer_cfg.get("max_epochs", None)
    reached = [f"trainer.max_steps={max_steps}"] if max_steps is not None and 0 <= max_steps <= step else []
    if max_epochs is not None and 0 <= max_epochs <= epochs:
        reached.append(f"trainer.max_epochs={max_epochs}")
    budget = trainer_cfg.get("max_time", None)
    if budget is not None:
        timer = Timer(duration=OmegaConf.to_container(budget) if OmegaConf.is_config(budget) else budget)
        for key, state in checkpoint.get("callbacks", {}).items():  # Lightning's timer, where the run had one
            if key.startswith("Timer"):
                timer.load_state_dict(state)
        if timer.time_remaining("train") <= 0:
            reached.append(f"trainer.max_time={budget} ({timer.time_elapsed('train'):.0f} s trained)")
    if reached:
        raise NothingToTrainError(nothing_to_train(path, step, epochs, ", ".join(reached)))


def finished_epochs(checkpoint: dict) -> int:
    """The epochs a Lightning checkpoint had finished (one saved at an epoch's end counts that epoch)."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    return int(progress.get("processed", checkpoint.get("epoch", 0)))


def nothing_to_train(path: str, step: int, epochs: int, limits: str) -> str:
    return (
        f"ckpt_path={path} is at step {step} after {epochs} epochs, where this run's limits end training ({limits}): "
        "nothing to train, so nothing is written; raise trainer.max_epochs, max_steps or max_time to train further"
    )


def check_trained(path: str | None, start_step: int | None, trainer) -> None:
    """After a fit resumed from the checkpoint at `path` at `start_step`: refuse to go on (export a drafter, write
    metrics) when it trained no step, the checkpoint having reached the run's limits already (Lightning then runs no
    loop at all, and says nothing). A backstop: `check_left_to_train` refuses such a resume before it starts."""
    if path is None or trainer.global_step != start_step:
        return
    limits = f"trainer.max_epochs={trainer.max_epochs}, trainer.max_steps={trainer.max_steps}"
    raise NothingToTrainError(nothing_to_train(path, trainer.global_step, trainer.current_epoch, limits))
