"""The Lightning module: a frozen target and K trainable Medusa heads on its last hidden state.

Only `self.heads` trains. The loss is sum_k decay^k * loss_k over heads k = 1..K, each on assistant tokens only, with
an optional KL term to the target's own distribution (see `losses.py`). The frozen target, checkpoints (keys
`heads.*`), the target cache (here of the target's last hidden state) and the optimizer are
`drafter_module.DrafterModule`'s.
"""

from collections.abc import Callable

import torch
import torch.nn as nn
from hydra.utils import instantiate
from torchmetrics import MeanMetric

from medusa_like.drafters.base import check_fits
from medusa_like.drafters.medusa import MEDUSA, HeadsConfig, MedusaHeads
from medusa_like.targets import output_logits
from medusa_like.training.drafter_module import DrafterModule
from medusa_like.training.losses import DECAY, IGNORE, decay_weights, head_labels, head_losses, shift_left, topk_correct
from medusa_like.training.target_cache import BATCH_TOKENS

TOPK = (1, 5)


class MedusaHeadsModule(DrafterModule):
    kind = MEDUSA.name
    checkpoint_prefix = "heads"
    progress_metric = "acc_top1_head1"

    def __init__(
        self,
        target: nn.Module,
        heads_config: HeadsConfig,
        target_name: str,
        optimizer: Callable,  # partial(torch.optim.AdamW, lr=...) from Hydra (`_partial_: true`)
        scheduler: Callable | None = None,  # partial(schedule, ...): (optimizer, total_steps=[, time_spent=])
        decay: float = DECAY,
        kl_weight: float = 0.0,  # mix of the soft-label KL to the target's own distribution
        kl_temperature: float = 1.0,
        target_cache_dir: str | None = None,  # compute the target's hidden states once, before the first step
        target_cache_batch_tokens: int = BATCH_TOKENS,  # padded tokens per target forward while building the cache
    ):
        super().__init__(target, target_name, optimizer, scheduler, target_cache_dir, target_cache_batch_tokens)
        if not 0 <= kl_weight <= 1 or not 0 < decay <= 1:
            raise ValueError(f"need 0 <= kl_weight <= 1 and 0 < decay <= 1, got kl_weight={kl_weight}, decay={decay}")
        check_fits(heads_config.hidden_size, heads_config.vocab_size, target, source="being trained")
        lm_head = target.get_output_embeddings()
        self.heads = MedusaHeads(heads_config, lm_head.weight.detach().float())
        self.decay, self.kl_weight, self.kl_temperature = decay, kl_weight, kl_temperature
        self.save_hyperparameters(
            {"heads": heads_config.to_dict(), "target": target_name, "decay": decay, "kl_weight": kl_weight}
        )
        names = [f"{m}_head{k}" for k in range(1, heads_config.num_heads + 1) for m in ("loss", "acc_top1", "acc_top5")]
        self.val_metrics = nn.ModuleDict({name: MeanMetric() for name in [*names, "loss"]})

    @classmethod
    def from_config(cls, cfg, target, **shared) -> "MedusaHeadsModule":
        """The heads of `cfg.drafter` (conf/drafter/medusa.yaml) sized for `target`'s width and vocabulary."""
        lm_head = target.get_output_embeddings().weight
        heads = instantiate(cfg.drafter.heads, vocab_size=lm_head.shape[0], hidden_size=lm_head.shape[1])
        return instantiate(cfg.drafter.module, heads_config=heads, target=target, **shared, _convert_="object")

    def drafter_meta(self) -> dict:
        return {"heads_config": self.heads.config.to_dict()}

    def cache_content(self) -> dict:
        """The cache holds the target's last hidden state (after the final norm) in the target's dtype, the heads'
        input and, through the frozen lm_head, the KL term's teacher: it depends on nothing else."""
        return {"fields": ["hidden"]}

    @torch.no_grad()
    def cacheable_outputs(self, batch: dict) -> dict[str, torch.Tensor]:
        return {"hidden": self.target_hidden(batch)}

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
        hidden = self.read_target(batch, self.cacheable_outputs)["hidden"]  # [B, T, H]
        features = hidden[selected].to(next(self.heads.parameters()).dtype)  # [N, H]
        logits = self.heads(features, self._project)  # [K, N, V]
        labels = labels[:, selected]  # [K, N]
        teacher = None
        if self.kl_weight > 0:
            with torch.no_grad():
                teacher = torch.stack(
                    [self._project(shift_left(hidden, k)[selected]) for k in range(1, self.heads.num_heads + 1)]
                )  # [K, N, V]: the target's logits at t + k
        per_head, counts = head_losses(logits, labels, teacher, self.kl_weight, self.kl_temperature)
        loss = (decay_weights(self.heads.num_heads, self.decay, first=1, device=per_head.device) * per_head).sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} (per head {per_head.tolist()}) at step {self.global_step} on rows "
                f"{batch['index'].tolist()}: lower the learning rate or check the data and precision"
            )
        return loss, per_head.detach(), counts, topk_correct(logits.detach(), labels, TOPK)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """The target's frozen projection (soft-capped as it decodes) on head features [..., H] -> logits [..., V],
        in the features' dtype."""
        return output_logits(self.target, x).to(x.dtype)
