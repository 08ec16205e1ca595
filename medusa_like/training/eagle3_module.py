"""The Lightning module for the EAGLE-3-style drafter: a frozen target, a trainable one-layer drafter, and the
training-time-test loss (`ttt.py`) unrolled over `ttt_steps` draft steps, step j weighted by `decay ** j`.

One frozen target forward per batch gives the aux hidden states (the drafter's input) and the last hidden state
(the labels: the target's distribution over the draft vocabulary); with `hidden_cache_dir` both are stored during the
first epoch and later epochs skip the target. The frozen target, checkpoints (keys `drafter.*`, with the drafter config
and the draft vocabulary in their metadata), the cache and the optimizer are `drafter_module.DrafterModule`'s.
"""

from collections.abc import Callable

import torch
import torch.nn as nn
from torchmetrics import MeanMetric
from transformers import DynamicCache

from medusa_like.drafters.base import check_fits
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.targets import output_logits
from medusa_like.training.drafter_module import DrafterModule
from medusa_like.training.losses import decay_weights, shift_left
from medusa_like.training.ttt import soft_cross_entropy, supervised_rows, unrolled_mask

_PROJECTION_ROWS = 1024  # positions per chunk of the target's full projection (bounds memory: 1024 x V floats)


class Eagle3Module(DrafterModule):
    checkpoint_prefix = "drafter"
    progress_metric = "acc_top1_depth1"

    def __init__(
        self,
        target: nn.Module,
        vocab: DraftVocab,
        target_name: str,
        optimizer: Callable,  # partial(torch.optim.AdamW, lr=...) from Hydra (`_partial_: true`)
        scheduler: Callable | None = None,  # partial(schedule, ...): (optimizer, total_steps=[, time_spent=])
        aux_layer_ids: list[int] | None = None,  # null: layers 2, L/2 and L-3
        ttt_steps: int = 4,  # unrolled draft steps (EAGLE-3: 7)
        decay: float = 0.8,  # step j's loss is weighted decay^j
        init_from_target: bool = True,  # start lm_head and the final norm from the target's
        hidden_cache_dir: str | None = None,  # cache the target's hidden states here during the first epoch
    ):
        super().__init__(target, target_name, optimizer, scheduler, hidden_cache_dir)
        if ttt_steps < 1 or not 0 < decay <= 1:
            raise ValueError(f"need ttt_steps >= 1 and 0 < decay <= 1, got ttt_steps={ttt_steps}, decay={decay}")
        check_fits(target.config.get_text_config().hidden_size, vocab.target_vocab_size, target, source="being trained")
        config = Eagle3Config.for_target(target.config, vocab.size, aux_layer_ids)
        self.drafter = Eagle3Drafter(config, vocab)
        if init_from_target:
            self.drafter.init_from_target(target)
        self.ttt_steps, self.decay = ttt_steps, decay
        self.save_hyperparameters(
            {"drafter": "eagle3", "target": target_name, "ttt_steps": ttt_steps, "decay": decay, "vocab": vocab.size}
        )
        names = [f"{m}_depth{d}" for d in range(1, ttt_steps + 1) for m in ("loss", "acc_top1")]
        self.val_metrics = nn.ModuleDict({name: MeanMetric() for name in [*names, "loss"]})

    def drafter_meta(self) -> dict:
        return {
            "kind": "eagle3",
            "config": self.drafter.config.to_dict(),
            "draft_token_ids": self.drafter.token_ids.tolist(),
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

    def _forward(self, batch: dict):
        """Returns (weighted loss, loss per step [S], [(top-1 hits, supervised rows)] per step)."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B, T]
        wanted = supervised_rows(batch["loss_mask"], attention_mask)  # [B, T]
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
        loss = (decay_weights(self.ttt_steps, self.decay, device=per_step.device) * per_step).sum()
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
        hidden = self.target_hidden(batch, self.drafter.config.aux_layer_ids)  # [B, T, (n+1)*h]
        size = self.target.config.get_text_config().hidden_size
        aux, last = hidden[..., :-size], hidden[..., -size:]
        rows = self.drafter.token_ids
        draft_logits, in_vocab = [], []
        for chunk in last[wanted].split(_PROJECTION_ROWS):  # [n, h]
            full = output_logits(self.target, chunk).float()  # [n, V]: soft-capped as the target decodes
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
