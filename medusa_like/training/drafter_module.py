"""What every drafter's Lightning module shares: a frozen target, checkpoints that hold the drafter alone, the target's
hidden states (from an optional cache, or with data echoing from a memo of the latest rows), the optimizer and
schedule, and the validation metrics.

A drafter's module (`medusa_module.py`, `eagle3_module.py`) names the drafter kind it trains (`kind`), builds itself
from a training config (`from_config`, called by `build.build_module`), builds its drafter, names it
`checkpoint_prefix` and says what the checkpoint records about it (`drafter_meta`); it writes its own loss. The target is never trained and never
saved: `state_dict` is the drafter's alone (keys `<prefix>.*`), and `checkpoint[CHECKPOINT_KEY]` records the drafter's
kind and config with the target's name and fingerprint, for `medusa_like.formats` (export and strict loading).
"""

from collections.abc import Callable

import lightning as L
import torch
import torch.nn as nn

from medusa_like.drafters.base import CHECKPOINT_KEY
from medusa_like.targets import freeze, target_fingerprint
from medusa_like.training.hidden_cache import HiddenStateCache
from medusa_like.training.schedule import budget_spent, total_optimizer_steps
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
        hidden_cache_dir: str | None = None,  # cache the target's hidden states here during the first epoch
    ):
        super().__init__()
        self.target = freeze(target)  # in its own dtype: `model.dtype`, which the loader applied
        self.target_name = target_name
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.cache = HiddenStateCache(hidden_cache_dir) if hidden_cache_dir else None
        self.hidden_memo: TargetMemo | None = None  # the latest rows' hidden states, when the data echoes rows
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
        }

    # ---- the target's side ----------------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        """With data echoing (`data/echo.py`) and no hidden-state cache, keep the latest rows' hidden states so that
        each row is read through the target once (a module whose own memo holds more, EAGLE-3's, overrides this)."""
        rows = getattr(self.trainer.datamodule, "echo_rows", 0)
        if rows and self.cache is None:
            self.hidden_memo = TargetMemo(rows)

    @torch.no_grad()
    def target_hidden(self, batch: dict, layers: list[int] | None = None) -> torch.Tensor:
        """The target's hidden states [B, T, (len(layers) + 1) * H]: `hidden_states[i]` for i in `layers`, then the
        last hidden state (after the final norm); from the cache when it holds every row of the batch, or in training
        from the memo of the latest rows (data echoing)."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B, T]
        indices, lengths = batch["index"].tolist(), attention_mask.sum(-1)
        if self.cache is not None:
            cached = self.cache.get(indices, input_ids.shape[1])
            if cached is not None:
                return cached.to(self.device)
        memo = self.hidden_memo if self.training else None
        if memo is not None and (held := memo.get(indices, input_ids, lengths)) is not None:
            return held["hidden"]
        with torch.autocast(self.device.type, enabled=False):  # the target runs in its own dtype, never autocast
            out = self.target.base_model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=bool(layers)
            )
        hidden = torch.cat([*(out.hidden_states[i] for i in layers or []), out.last_hidden_state], dim=-1)
        if self.cache is not None:
            self.cache.put(indices, hidden, lengths)
        if memo is not None:
            memo.put(indices, input_ids, lengths, {"hidden": hidden})
        return hidden

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

    def on_fit_end(self) -> None:
        if self.cache is not None and self.trainer.is_global_zero:
            self.cache.clear()
