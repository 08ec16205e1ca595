"""What every drafter's Lightning module shares: a frozen target, checkpoints that hold the drafter alone, the target's
side of each batch (from the target cache, or with data echoing from a memo of the latest rows), the optimizer and
schedule, what a resumed run must match, and the validation metrics.

A drafter's module (`medusa_module.py`, `eagle3_module.py`) names the drafter kind it trains (`kind`), builds itself
from a training config (`from_config`, called by `build.build_module`), builds its drafter, names it
`checkpoint_prefix` and says what the checkpoint records about it (`drafter_meta`); it says what the target cache holds
for it (`cache_content`, `cacheable_outputs`) and writes its own loss. The target is never trained and never saved:
`state_dict` is the drafter's alone (keys `<prefix>.*`), and `checkpoint[CHECKPOINT_KEY]` records the drafter's kind
and config with the target's name and fingerprint, for `medusa_like.formats` (export and strict loading);
`checkpoint[RESUME_KEY]` records the settings a resumed run is checked against (`resume.py`).
"""

from collections.abc import Callable

import lightning as L
import torch
import torch.nn as nn

from medusa_like.drafters.base import CHECKPOINT_KEY
from medusa_like.targets import freeze, target_fingerprint, weights_fingerprint, weights_identity
from medusa_like.training.resume import RESUME_KEY, apply_optimizer_settings, finish_epoch_end_state
from medusa_like.training.schedule import budget_spent, total_optimizer_steps
from medusa_like.training.target_cache import BATCH_TOKENS, TargetCache, cache_key
from medusa_like.training.target_memo import TargetMemo


class DrafterModule(L.LightningModule):
    kind: str  # the registered drafter kind it trains (`drafters/registry.py`), recorded in its checkpoints
    checkpoint_prefix: str  # the drafter's attribute name, and its keys' prefix in checkpoints
    progress_metric: str  # the validation metric shown in the progress bar

    def __init__(
        self,
        target: nn.Module,
        target_name: str,
        optimizer: Callable,  # partial(torch.optim.AdamW, lr=...) from Hydra (`_partial_: true`)
        scheduler: Callable | None = None,  # partial(schedule, ...): (optimizer, total_steps=[, time_spent=])
        target_cache_dir: str | None = None,  # compute the target's side once, before the first step, and reuse it
        target_cache_batch_tokens: int = BATCH_TOKENS,  # padded tokens per target forward while building the cache
    ):
        super().__init__()
        self.target = freeze(target)  # in its own dtype: `model.dtype`, which the loader applied
        self.target_name = target_name
        # what the target cache and the checkpoints are keyed by: the weights, not the architecture or the name
        self.target_weights = weights_fingerprint(target)
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.target_cache_dir, self.target_cache_batch_tokens = target_cache_dir, target_cache_batch_tokens
        self.target_cache: TargetCache | None = None  # opened in `prepare_target_cache`
        self.memo: TargetMemo | None = None  # the latest rows' target outputs, when the data echoes rows
        self.resume_settings: dict | None = None  # recorded in checkpoints: what a resume must match (`resume.py`)
        # DDP need not broadcast or watch the frozen target
        self._ddp_params_and_buffers_to_ignore = [f"target.{n}" for n, _ in target.named_parameters()] + [
            f"target.{n}" for n, _ in target.named_buffers()
        ]

    @property
    def drafter(self) -> nn.Module:
        """The trained drafter (a registered submodule named `checkpoint_prefix`)."""
        return self._modules[self.checkpoint_prefix]

    @classmethod
    def from_config(cls, cfg, target, **shared) -> "DrafterModule":
        """The module for `target` from a composed training config: `cfg.drafter` (conf/drafter/<kind>.yaml, whose
        `module` names this class) with `shared`, the settings of `cfg.module` every kind takes (`build.build_module`)."""
        raise NotImplementedError

    def drafter_meta(self) -> dict:
        """The drafter's config, as its checkpoint records it (beside its `kind`)."""
        raise NotImplementedError

    def cache_content(self) -> dict:
        """What the target cache holds for this drafter: `fields`, the names `cacheable_outputs` returns, and every
        setting besides the target's weights, its dtype and the rows that their values depend on (part of the key)."""
        raise NotImplementedError

    def cacheable_outputs(self, batch: dict) -> dict[str, torch.Tensor]:
        """The target's side of a right-padded batch (on any device) as the cache stores it: `cache_content()`'s
        fields, [B, T, ...] each."""
        raise NotImplementedError

    # ---- the frozen target stays frozen; checkpoints hold the drafter only --------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()
        return self

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        own = f"{prefix}{self.checkpoint_prefix}."
        return self.drafter.state_dict(destination=destination, prefix=own, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        own = f"{self.checkpoint_prefix}."
        foreign = [k for k in state_dict if not k.startswith(own)]
        if foreign:
            raise KeyError(f"expected only '{own}*' keys in a {self.checkpoint_prefix} checkpoint, found {foreign[:5]}")
        weights = {k.removeprefix(own): v for k, v in state_dict.items()}
        return self.drafter.load_state_dict(weights, strict=True, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        own = f"{self.checkpoint_prefix}."
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith(own)}
        checkpoint[CHECKPOINT_KEY] = {
            "kind": self.kind,
            **self.drafter_meta(),
            "target": self.target_name,
            "target_fingerprint": target_fingerprint(self.target.config),
            "target_weights": weights_identity(self.target),  # which weights, in any dtype (drafters/base.py)
        }
        if self.resume_settings is not None:
            checkpoint[RESUME_KEY] = self.resume_settings

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self._trainer is not None:  # a resumed fit, before Lightning's loops read their state
            finish_epoch_end_state(checkpoint, self._trainer.max_steps)

    def on_train_start(self) -> None:
        """A resumed run: put the run's optimizer settings (learning rate, betas, weight decay) in place of the
        checkpoint's, which Lightning restored with the optimizer's state (`resume.py`)."""
        if not self.trainer.ckpt_path:
            return
        scheduler = self.lr_schedulers() if self.scheduler_factory is not None else None
        apply_optimizer_settings(self.optimizers().optimizer, scheduler, self.optimizer_factory)

    # ---- the target's side ----------------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        """Build or open the target cache (`target_cache_dir`); without one, with data echoing (`data/echo.py`), keep
        the latest rows' target outputs in memory so that each row is read through the target once."""
        data = self.trainer.datamodule
        self.prepare_target_cache(data, self.trainer.is_global_zero, self.trainer.strategy.barrier)
        if self.target_cache is None and getattr(data, "echo_rows", 0):  # a cache already serves every repeat
            self.memo = TargetMemo(data.echo_rows)

    def prepare_target_cache(self, data, builder: bool = True, barrier=lambda: None) -> None:
        """With `target_cache_dir`: compute the target's side of every training and validation row of `data` (a
        set-up `TrainingDataModule`) not cached yet (on the `builder` rank; the others wait at `barrier`), then read
        every batch from the cache."""
        if not self.target_cache_dir:
            return
        key = cache_key(self.target_weights, self.target.dtype, self.cache_content(), data.max_length)
        if builder:
            rows = [row for split in (data.train_set, data.val_set) for row in split]
            TargetCache(self.target_cache_dir, key).build(
                rows, self._cacheable_on_device, self.target_cache_batch_tokens
            )
        barrier()
        self.target_cache = TargetCache(self.target_cache_dir, key)

    @torch.no_grad()
    def _cacheable_on_device(self, batch: dict) -> dict[str, torch.Tensor]:
        return self.cacheable_outputs({k: v.to(self.device) for k, v in batch.items()})

    @torch.no_grad()
    def read_target(self, batch: dict, compute: Callable[[dict], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The target's side of a batch: from the target cache when there is one, else in training from the memo of
        the latest rows when it holds them all (data echoing), else `compute(batch)` (then kept in the memo)."""
        indices, lengths = batch["index"].tolist(), batch["attention_mask"].sum(-1)
        if self.target_cache is not None:
            cached = self.target_cache.get(indices, batch["input_ids"], lengths)
            return {name: t.to(self.device) for name, t in cached.items()}
        memo = self.memo if self.training else None
        if memo is not None and (held := memo.get(indices, batch["input_ids"], lengths)) is not None:
            return held
        out = compute(batch)
        if memo is not None:
            memo.put(indices, batch["input_ids"], lengths, out)
        return out

    @torch.no_grad()
    def target_hidden(self, batch: dict, layers: list[int] | None = None) -> torch.Tensor:
        """The target's hidden states [B, T, (len(layers) + 1) * H]: `hidden_states[i]` for i in `layers`, then the
        last hidden state (after the final norm), from one forward of the target in its own dtype."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B, T]
        with torch.autocast(self.device.type, enabled=False):  # the target runs in its own dtype, never autocast
            out = self.target.base_model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=bool(layers)
            )
        return torch.cat([*(out.hidden_states[i] for i in layers or []), out.last_hidden_state], dim=-1)

    # ---- metrics and optimisation -------------------------------------------------------------------------------
    def on_validation_epoch_end(self) -> None:
        for name, metric in self.val_metrics.items():  # compute() syncs across ranks: every rank calls it
            if metric.update_count:
                self.log(f"val/{name}", metric.compute(), prog_bar=name == self.progress_metric)
            metric.reset()

    def configure_optimizers(self):
        optimizer = self.optimizer_factory([p for p in self.drafter.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return optimizer
        spent = budget_spent(self.trainer)  # under a time budget the schedule also follows the time spent
        budget = {} if spent is None else {"time_spent": spent}
        scheduler = self.scheduler_factory(optimizer, total_steps=total_optimizer_steps(self.trainer), **budget)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
