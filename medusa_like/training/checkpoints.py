"""`checkpoints/last.ckpt`, the checkpoint `ckpt_path=last` resumes from: written every N optimizer steps (when asked),
at every training epoch end, and when training ends; and checkpoints at token milestones, for learning curves.

Lightning's `ModelCheckpoint` treats `every_n_train_steps` and `every_n_epochs` as mutually exclusive: with the former
set it saves nothing at an epoch end, so a run's final `last.ckpt` could lag its last steps. This subclass adds the
epoch-end and end-of-training saves, and leaves an epoch's last batch to the epoch-end save; a run that stops inside an
epoch is saved at that batch's end, so that a resume goes on inside the epoch; a step already saved is not saved
twice.
"""

from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from medusa_like.io import write_json


class LastCheckpoint(ModelCheckpoint):
    def __init__(self, dirpath: str, every_n_train_steps: int | None = None, filename: str = "last"):
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=None,
            save_top_k=1,  # one file, overwritten
            every_n_train_steps=every_n_train_steps,
            save_on_train_epoch_end=True,
            enable_version_counter=False,
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # an epoch's last batch is saved at the epoch's end instead: Lightning resumes a checkpoint written between the
        # two as if that epoch and the next were done (a run resumed from it trains one epoch less)
        if batch_idx + 1 >= trainer.num_training_batches:
            return
        if trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step:
            # training ends inside the epoch (max_steps, max_time, a callback): saved here, mid-epoch, where a resume
            # goes on with the epoch's next batch. Saved at the epoch's end, Lightning would count the cut epoch as
            # done and resume into an epoch whose batches it takes as served (a resume given more steps trained none)
            self._save_now(trainer)
        else:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)  # saves here only without every_n_train_steps
        self._save_now(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_now(trainer)  # max_steps can end a run mid-epoch

    def _save_now(self, trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # fast_dev_run, not fitting, or this step saved already
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))


class TokenMilestones(Callback):
    """Save `tokens-<n>.ckpt` when the supervised tokens trained on (assistant tokens, `loss_mask`, summed over every
    batch, repeats of later epochs included) first reach each of `milestones`; `milestones.json` lists them with the
    step. The points of a learning curve (`python -m eval.bench learning_curve`) from one run: each checkpoint is the drafter after
    that many tokens, with the learning-rate schedule of the whole run. With `stop_at_last`, training stops once the
    last milestone is saved."""

    def __init__(self, dirpath: str, milestones: list[int], stop_at_last: bool = True):
        if not milestones or any(int(m) < 1 for m in milestones):
            raise ValueError(f"milestones must be positive token counts, got {milestones}")
        self.dirpath = Path(dirpath)
        self.milestones = sorted(int(m) for m in milestones)
        self.stop_at_last = stop_at_last
        self.tokens = 0
        self.saved: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.tokens += int(batch["loss_mask"].sum()) * trainer.world_size
        due = [m for m in self.milestones if m <= self.tokens and m not in {s["milestone"] for s in self.saved}]
        if not due or not trainer.is_global_zero:
            return
        path = self.dirpath / f"tokens-{due[-1]}.ckpt"
        trainer.save_checkpoint(path)
        self.saved += [
            {"milestone": m, "tokens": self.tokens, "step": trainer.global_step, "path": path.name} for m in due
        ]
        write_json(self.dirpath / "milestones.json", self.saved)
        if self.stop_at_last and self.milestones[-1] in due:
            trainer.should_stop = True

    def state_dict(self) -> dict:
        return {"tokens": self.tokens, "saved": self.saved}

    def load_state_dict(self, state_dict: dict) -> None:
        self.tokens, self.saved = state_dict["tokens"], state_dict["saved"]
