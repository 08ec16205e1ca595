"""The Lightning module for the EAGLE-3-style drafter: a frozen target, a trainable one-layer drafter, and the
training-time-test loss (`ttt.py`) unrolled over `ttt_steps` draft steps, step j weighted by `decay ** j`.

One frozen target forward per batch gives the aux hidden states (the drafter's input) and the last hidden state
(the labels: the target's distribution over the draft vocabulary); with `hidden_cache_dir` both are stored during the
first epoch and later epochs skip the target. Checkpoints hold the drafter, the optimizer and the schedule, never the
target: `state_dict` is the drafter's alone (keys `drafter.*`), and the checkpoint's metadata records the drafter
config, the draft vocabulary and the target's name and fingerprint, for export and strict loading.
"""

from collections.abc import Callable

import lightning as L
import torch
import torch.nn as nn
from torchmetrics import MeanMetric
from transformers import DynamicCache

from medusa_like.drafters.base import CHECKPOINT_KEY, check_fits
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.targets import freeze, target_fingerprint
from medusa_like.training.hidden_cache import HiddenStateCache
from medusa_like.training.schedule import total_optimizer_steps
from medusa_like.training.ttt import shift_left, soft_cross_entropy, step_weights, supervised_rows, unrolled_mask

_PROJECTION_ROWS = 1024  # positions per chunk of the target's full projection (bounds memory: 1024 x V floats)


class Eagle3Module(L.LightningModule):
    def __init__(
        self,
        target: nn.Module,
        vocab: DraftVocab,
        target_name: str,
        optimizer: Callable,  # partial(torch.optim.AdamW, lr=...) from Hydra (`_partial_: true`)
        scheduler: Callable | None = None,  # partial(schedule, ...) called with (optimizer, total_steps=...)
        aux_layer_ids: list[int] | None = None,  # null: layers 2, L/2 and L-3
        ttt_steps: int = 4,  # unrolled draft steps (EAGLE-3: 7)
        target_dtype: str | None = None,  # e.g. bfloat16: the frozen target's dtype for training (features, labels)
        decay: float = 0.8,  # step j's loss is weighted decay^j
        init_from_target: bool = True,  # start lm_head and the final norm from the target's
        hidden_cache_dir: str | None = None,  # cache the target's hidden states here during the first epoch
    ):
        super().__init__()
        if ttt_steps < 1 or not 0 < decay <= 1:
            raise ValueError(f"need ttt_steps >= 1 and 0 < decay <= 1, got ttt_steps={ttt_steps}, decay={decay}")
        self.target = freeze(target.to(getattr(torch, target_dtype)) if target_dtype else target)
        check_fits(target.config.get_text_config().hidden_size, vocab.target_vocab_size, target, source="being trained")
        config = Eagle3Config.for_target(target.config, vocab.size, aux_layer_ids)
        self.drafter = Eagle3Drafter(config, vocab)
        if init_from_target:
            self.drafter.init_from_target(target)
        self.target_name = target_name
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.ttt_steps, self.decay = ttt_steps, decay
        self.cache = HiddenStateCache(hidden_cache_dir) if hidden_cache_dir else None
        self._ddp_params_and_buffers_to_ignore = [f"target.{n}" for n, _ in target.named_parameters()] + [
            f"target.{n}" for n, _ in target.named_buffers()
        ]
        self.save_hyperparameters(
            {"drafter": "eagle3", "target": target_name, "ttt_steps": ttt_steps, "decay": decay, "vocab": vocab.size}
        )
        names = [f"{m}_depth{d}" for d in range(1, ttt_steps + 1) for m in ("loss", "acc_top1")]
        self.val_metrics = nn.ModuleDict({name: MeanMetric() for name in [*names, "loss"]})

    # ---- the frozen target stays frozen; checkpoints hold the drafter only --------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()
        return self

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.drafter.state_dict(destination=destination, prefix=f"{prefix}drafter.", keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        foreign = [k for k in state_dict if not k.startswith("drafter.")]
        if foreign:
            raise KeyError(f"expected only 'drafter.*' keys in a drafter checkpoint, found {foreign[:5]}")
        own = {k.removeprefix("drafter."): v for k, v in state_dict.items()}
        return self.drafter.load_state_dict(own, strict=True, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("drafter.")}
        checkpoint[CHECKPOINT_KEY] = {
            "kind": "eagle3",
            "config": self.drafter.config.to_dict(),
            "draft_token_ids": self.drafter.token_ids.tolist(),
            "target": self.target_name,
            "target_fingerprint": target_fingerprint(self.target.config),
        }

    # ---- steps --------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, per_step, accuracy = self._forward(batch)
        size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=size)
        for j in range(self.ttt_steps):
            self.log(f"train/loss_depth{j + 1}", per_step[j], batch_size=size)
            self.log(f"train/acc_top1_depth{j + 1}", accuracy[j][0] / accuracy[j][1].clamp(min=1), batch_size=size)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, per_step, accuracy = self._forward(batch)
        self.val_metrics["loss"].update(loss)
        for j in range(self.ttt_steps):
            hits, count = accuracy[j]
            self.val_metrics[f"loss_depth{j + 1}"].update(per_step[j], weight=count)
            self.val_metrics[f"acc_top1_depth{j + 1}"].update(hits / count.clamp(min=1), weight=count)

    def on_validation_epoch_end(self) -> None:
        for name, metric in self.val_metrics.items():  # compute() syncs across ranks: every rank calls it
            if metric.update_count:
                self.log(f"val/{name}", metric.compute(), prog_bar=name == "acc_top1_depth1")
            metric.reset()

    def _forward(self, batch: dict):
        """Returns (weighted loss, loss per step [S], [(top-1 hits, supervised rows)] per step)."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B, T]
        wanted = supervised_rows(batch["loss_mask"], attention_mask, torch.ones_like(attention_mask, dtype=torch.bool))
        aux, teacher_logp, labelled = self._target_outputs(batch, wanted)  # [B, T, n*h], [B, T, N], [B, T]
        if not labelled.any():
            raise ValueError(
                f"batch of rows {batch['index'].tolist()} has no supervised assistant token whose target argmax is in "
                f"the draft vocabulary: the loss would be 0; check the loss_mask of the data and the vocabulary size"
            )
        batch_size, width = input_ids.shape
        positions = torch.arange(width, device=input_ids.device)[None].expand(batch_size, -1)  # [B, T]
        embed = self.target.get_input_embeddings()
        feature = self.drafter.fuse(aux)  # [B, T, h]
        cache = DynamicCache()
        losses, accuracy = [], []
        for j in range(self.ttt_steps):
            embeds = embed(shift_left(input_ids, 1 + j)).to(feature.dtype)  # token t + 1 + j
            state = self.drafter(feature, embeds, positions + j, unrolled_mask(attention_mask, j), cache)
            valid = shift_left(labelled, 1 + j, fill=False)  # [B, T]: rows with a label at this step
            logits = self.drafter.logits(state[valid])  # [n, N]: only rows with a label pay the projection
            teacher = shift_left(teacher_logp, 1 + j)[valid]  # the target after token t + 1 + j
            losses.append(soft_cross_entropy(logits, teacher))
            hits = (logits.argmax(-1) == teacher.argmax(-1)).sum()
            accuracy.append((hits.detach(), valid.sum()))
            feature = state  # the next step reads the drafter's own output
        per_step = torch.stack(losses)  # [S]
        loss = (step_weights(self.ttt_steps, self.decay, per_step.device) * per_step).sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} (per step {per_step.tolist()}) at step {self.global_step} on rows "
                f"{batch['index'].tolist()}: lower the learning rate or check the data and precision"
            )
        return loss, per_step.detach(), accuracy

    @torch.no_grad()
    def _target_outputs(self, batch: dict, wanted: torch.Tensor):
        """The target's side of a batch: aux hidden states [B, T, n*h]; its log-probabilities over the draft
        vocabulary [B, T, N] at the `wanted` [B, T] positions (zero elsewhere); and which positions are labelled
        (wanted, and the target's argmax over its full vocabulary is a draft token) [B, T]."""
        hidden = self._target_hidden(batch)  # [B, T, (n+1)*h]: aux then the last hidden state
        size = self.target.config.get_text_config().hidden_size
        aux, last = hidden[..., :-size], hidden[..., -size:]
        projection = self.target.get_output_embeddings()
        rows = self.drafter.token_ids
        draft_logits, in_vocab = [], []
        for chunk in last[wanted].split(_PROJECTION_ROWS):  # [n, h]
            full = projection(chunk.to(projection.weight.dtype)).float()  # [n, V]
            draft_logits.append(full[:, rows])
            in_vocab.append(self.drafter_vocab_mask[full.argmax(-1)])
        teacher = last.new_zeros(*last.shape[:-1], rows.numel(), dtype=torch.float32)  # [B, T, N]
        labelled = torch.zeros_like(wanted)
        if draft_logits:
            teacher[wanted] = torch.cat(draft_logits).log_softmax(-1)
            labelled[wanted] = torch.cat(in_vocab)
        return aux, teacher, labelled

    @property
    def drafter_vocab_mask(self) -> torch.Tensor:
        if getattr(self, "_t2d", None) is None or self._t2d.device != self.device:
            self._t2d = self.drafter.vocab.t2d.to(self.device)
        return self._t2d

    def _target_hidden(self, batch: dict) -> torch.Tensor:
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B, T]
        indices = batch["index"].tolist()
        if self.cache is not None:
            cached = self.cache.get(indices, input_ids.shape[1])
            if cached is not None:
                return cached.to(self.device)
        with torch.autocast(self.device.type, enabled=False):  # the target runs in its own dtype, never autocast
            out = self.target.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        layers = self.drafter.config.aux_layer_ids
        hidden = torch.cat([*(out.hidden_states[i] for i in layers), out.last_hidden_state], dim=-1)
        if self.cache is not None:
            self.cache.put(indices, hidden, attention_mask.sum(-1))
        return hidden

    # ---- optimisation -------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = self.optimizer_factory([p for p in self.drafter.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer, total_steps=total_optimizer_steps(self.trainer))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_end(self) -> None:
        if self.cache is not None and self.trainer.is_global_zero:
            self.cache.clear()
