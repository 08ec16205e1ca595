"""`checkpoints/last.ckpt`, the checkpoint `ckpt_path=last` resumes from: written every N optimizer steps (when asked),
at every training epoch end, and when training ends.

Lightning's `ModelCheckpoint` treats `every_n_train_steps` and `every_n_epochs` as mutually exclusive: with the former
set it saves nothing at an epoch end, so a run's final `last.ckpt` could lag its last steps. This subclass adds the
epoch-end and end-of-training saves; a step already saved is not saved twice.
"""

from lightning.pytorch.callbacks import ModelCheckpoint


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

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)  # saves here only without every_n_train_steps
        self._save_now(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_now(trainer)  # max_steps can end a run mid-epoch

    def _save_now(self, trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # fast_dev_run, not fitting, or this step saved already
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
