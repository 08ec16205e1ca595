"""The Lightning module: a frozen target and K trainable Medusa heads on its last hidden state.

The target runs in eval mode without gradients (bf16 on GPU, fp32 on CPU, as loaded); only `self.heads` trains. The
loss is sum_k decay^k * loss_k over heads k = 1..K, each on assistant tokens only, with an optional KL term to the
target's own distribution (see `losses.py`). Checkpoints hold the heads, the optimizer and the schedule, never the
target: `state_dict` is the heads' alone (keys `heads.*`), and `checkpoint[CHECKPOINT_KEY]` records the heads config
and the target's name and fingerprint for `medusa_like.formats` (export and strict loading).
"""

from collections.abc import Callable

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import MeanMetric

from medusa_like.drafters.base import CHECKPOINT_KEY, check_fits
from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads
from medusa_like.targets import freeze, target_fingerprint
from medusa_like.training.hidden_cache import HiddenStateCache
from medusa_like.training.losses import IGNORE, head_labels, head_losses, head_weights, shifted, topk_correct
from medusa_like.training.schedule import total_optimizer_steps

TOPK = (1, 5)


class MedusaHeadsModule(L.LightningModule):
    def __init__(
        self,
        target: nn.Module,
        heads_config: HeadsConfig,
        target_name: str,
        optimizer: Callable,  # partial(torch.optim.AdamW, lr=...) from Hydra (`_partial_: true`)
        scheduler: Callable | None = None,  # partial(schedule, ...) called with (optimizer, total_steps=...)
        decay: float = 0.8,
        kl_weight: float = 0.0,  # mix of the soft-label KL to the target's own distribution
        kl_temperature: float = 1.0,
        hidden_cache_dir: str | None = None,  # cache the target's hidden states here during the first epoch
    ):
        super().__init__()
        if not 0 <= kl_weight <= 1 or not 0 < decay <= 1:
            raise ValueError(f"need 0 <= kl_weight <= 1 and 0 < decay <= 1, got kl_weight={kl_weight}, decay={decay}")
        self.target = freeze(target)
        check_fits(heads_config.hidden_size, heads_config.vocab_size, target, source="being trained")
        lm_head = target.get_output_embeddings()
        self.heads = MedusaHeads(heads_config, lm_head.weight.detach().float())
        self.target_name = target_name
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.decay, self.kl_weight, self.kl_temperature = decay, kl_weight, kl_temperature
        self.cache = HiddenStateCache(hidden_cache_dir) if hidden_cache_dir else None
        # DDP need not broadcast or watch the frozen target
        self._ddp_params_and_buffers_to_ignore = [f"target.{n}" for n, _ in target.named_parameters()] + [
            f"target.{n}" for n, _ in target.named_buffers()
        ]
        self.save_hyperparameters(
            {"heads": heads_config.to_dict(), "target": target_name, "decay": decay, "kl_weight": kl_weight}
        )
        names = [f"{m}_head{k}" for k in range(1, heads_config.num_heads + 1) for m in ("loss", "acc_top1", "acc_top5")]
        self.val_metrics = nn.ModuleDict({name: MeanMetric() for name in [*names, "loss"]})

    @property
    def drafter(self) -> MedusaHeads:
        """The trained drafter: the heads."""
        return self.heads

    # ---- the frozen target stays frozen -------------------------------------------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()
        return self

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.heads.state_dict(destination=destination, prefix=f"{prefix}heads.", keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        foreign = [k for k in state_dict if not k.startswith("heads.")]
        if foreign:
            raise KeyError(f"expected only 'heads.*' keys in a heads checkpoint, found {foreign[:5]}")
        heads_state = {k.removeprefix("heads."): v for k, v in state_dict.items()}
        return self.heads.load_state_dict(heads_state, strict=True, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("heads.")}
        checkpoint[CHECKPOINT_KEY] = {
            "kind": "medusa",
            "heads_config": self.heads.config.to_dict(),
            "target": self.target_name,
            "target_fingerprint": target_fingerprint(self.target.config),
        }

    # ---- steps --------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, per_head, counts, correct = self._forward(batch)
        size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=size)
        for k in range(self.heads.num_heads):
            n = counts[k].clamp(min=1)
            self.log(f"train/loss_head{k + 1}", per_head[k], batch_size=size)
            for top in TOPK:
                self.log(f"train/acc_top{top}_head{k + 1}", correct[top][k] / n, batch_size=size)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, per_head, counts, correct = self._forward(batch)
        self.val_metrics["loss"].update(loss)
        for k in range(self.heads.num_heads):
            n = counts[k]  # a head without positions here adds weight 0
            self.val_metrics[f"loss_head{k + 1}"].update(per_head[k], weight=n)
            for top in TOPK:
                self.val_metrics[f"acc_top{top}_head{k + 1}"].update(correct[top][k] / n.clamp(min=1), weight=n)

    def on_validation_epoch_end(self) -> None:
        for name, metric in self.val_metrics.items():  # compute() syncs across ranks: every rank calls it
            if metric.update_count:
                self.log(f"val/{name}", metric.compute(), prog_bar=name == "acc_top1_head1")
            metric.reset()

    def _forward(self, batch: dict):
        """Returns (weighted loss, loss per head [K], supervised positions per head [K], {k: top-k hits per head [K]})."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]  # [B, T]
        labels = head_labels(input_ids, loss_mask, self.heads.num_heads)  # [K, B, T]
        selected = (labels != IGNORE).any(0)  # [B, T]: positions some head learns from
        if not selected.any():
            raise ValueError(
                f"batch of rows {batch['index'].tolist()} has no supervised assistant token: the loss would be 0; "
                f"check the loss_mask of the distilled data"
            )
        hidden = self._hidden(batch)  # [B, T, H]
        features = hidden[selected].to(next(self.heads.parameters()).dtype)  # [N, H]
        logits = self.heads(features, self._project)  # [K, N, V]
        labels = labels[:, selected]  # [K, N]
        teacher = None
        if self.kl_weight > 0:
            with torch.no_grad():
                teacher = torch.stack(
                    [self._project(shifted(hidden, k)[selected]) for k in range(1, self.heads.num_heads + 1)]
                )  # [K, N, V]: the target's logits at t + k
        per_head, counts = head_losses(logits, labels, teacher, self.kl_weight, self.kl_temperature)
        loss = (head_weights(self.heads.num_heads, self.decay, per_head.device) * per_head).sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} (per head {per_head.tolist()}) at step {self.global_step} on rows "
                f"{batch['index'].tolist()}: lower the learning rate or check the data and precision"
            )
        return loss, per_head.detach(), counts, topk_correct(logits.detach(), labels, TOPK)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """The target's frozen projection on head features [..., H] -> logits [..., V], in the features' dtype."""
        proj = self.target.get_output_embeddings()
        return F.linear(x.to(proj.weight.dtype), proj.weight, proj.bias).to(x.dtype)

    @torch.no_grad()
    def _hidden(self, batch: dict) -> torch.Tensor:
        """The target's last hidden state (after the final norm) [B, T, H], from the cache when it has every row."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B, T]
        indices = batch["index"].tolist()
        if self.cache is not None:
            cached = self.cache.get(indices, input_ids.shape[1])
            if cached is not None:
                return cached.to(self.device)
        with torch.autocast(self.device.type, enabled=False):  # the target runs in its own dtype, never autocast
            hidden = self.target.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.cache is not None:
            self.cache.put(indices, hidden, attention_mask.sum(-1))
        return hidden

    # ---- optimisation -------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = self.optimizer_factory([p for p in self.heads.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer, total_steps=total_optimizer_steps(self.trainer))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_end(self) -> None:
        if self.cache is not None and self.trainer.is_global_zero:
            self.cache.clear()
