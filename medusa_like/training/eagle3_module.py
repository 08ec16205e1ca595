"""The Lightning module for the EAGLE-3-style drafter: a frozen target, a trainable one-layer drafter, and the
training-time-test loss (`ttt.py`) unrolled over `ttt_steps` draft steps, step j weighted by `decay ** j`.

One frozen target forward per batch gives the aux hidden states (the drafter's input) and the labels: the target's
distribution over the draft vocabulary, kept as its `top_k` most likely tokens (all of them when `top_k` is null;
`feature_labels.py`, shared with the block drafter's module).
With `target_cache_dir`, both are computed once for every row before the first step (`target_cache.py`, through
`drafter_module.DrafterModule`) and every epoch reads them back: training runs no target forward at all. When the data
echoes rows (`data/echo.py`), the latest rows' outputs are kept in memory (`target_memo.py`) and each row is read once. Validation reports, besides the
per-depth losses and accuracies, the acceptance length a chain of drafts would reach with those accuracies
(`val/sim_tau_chain`), by which the best checkpoint is chosen. The frozen target, checkpoints (keys `drafter.*`, with
the drafter config and the draft vocabulary in their metadata) and the optimizer are `drafter_module.DrafterModule`'s.
"""

import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from hydra.utils import instantiate
from torchmetrics import MeanMetric
from transformers import DynamicCache

from medusa_like.data.split import draft_vocab_from_training_split
from medusa_like.drafters.base import check_fits
from medusa_like.drafters.eagle3 import EAGLE3, Eagle3Config, Eagle3Drafter
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.training.feature_labels import TRAIN_ON, FeatureLabelsModule
from medusa_like.training.losses import DECAY, decay_weights, shift_left
from medusa_like.training.target_cache import BATCH_TOKENS
from medusa_like.training.ttt import loss_function, simulated_tau, unrolled_mask

log = logging.getLogger(__name__)


def layer_index(
    init_layer_from_target: int | str | None, aux_layer_ids: tuple[int, ...], num_layers: int
) -> int | None:
    """The target layer `init_layer_from_target` names: None for null, an index, or "high", the layer the last aux stream enters (the
    stream `fc` then passes through, so the drafter starts as that layer applied to its own input); None for "high"
    when that stream is the target's last state, which enters no layer (the layer then starts random, logged)."""
    if init_layer_from_target is None:
        return None
    if init_layer_from_target == "high":
        if aux_layer_ids[-1] < num_layers:
            return aux_layer_ids[-1]
        log.info("init_layer_from_target=high: the last aux stream is the target's output, entering no layer; the "
                 "drafter's layer starts random")  # fmt: skip
        return None
    if isinstance(init_layer_from_target, bool) or not isinstance(init_layer_from_target, int):
        raise ValueError(
            f"init_layer_from_target must be a target layer index, 'high' or null, got {init_layer_from_target!r}"
        )
    return init_layer_from_target


class Eagle3Module(FeatureLabelsModule):
    kind = EAGLE3.name
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
        decay: float = DECAY,  # step j's loss is weighted decay^j
        init_from_target: bool = True,  # start lm_head and the final norm from the target's
        freeze_lm_head: bool = False,  # keep lm_head at the target's rows, untrained (EAGLE-1/2 reuse the target's head)
        init_layer_from_target: int | str | None = None,  # a target layer's index, or "high" (the one the last aux
        # stream enters): start the decoder layer from that layer's weights
        init_embedding_from_feature: list[str] | None = None,  # of q_proj, k_proj, v_proj: their embedding half
        # starts as a copy of their feature half (the started layer's weights), not at zero
        top_k: int | None = 64,  # labels: the target's k most likely draft tokens (null: the whole draft vocabulary)
        norm_aux: bool = False,  # normalise each captured state before fc (EAGLE-3.1)
        loss: str = "soft_ce",  # per step: soft_ce, tv, lk or a weighted sum ("0.1*soft_ce+0.9*tv"), `ttt.loss_function`
        train_on: str = "assistant",  # training labels at the assistant's tokens, or at "all" real tokens (the
        # target's distribution is a label at any position); validation always measures the assistant's tokens
        vocab_check: bool = True,  # training leaves out rows whose target argmax is not a draft token (EAGLE-3's
        # rule, which needs the target's whole output projection); false: training projects onto the draft vocabulary
        # alone and labels every supervised row (validation and the target cache keep the rule)
        target_cache_dir: str | None = None,  # compute the target's side once, before the first step, and reuse it
        target_cache_batch_tokens: int = BATCH_TOKENS,  # padded tokens per target forward while building the cache
    ):
        super().__init__(target, target_name, optimizer, scheduler, target_cache_dir, target_cache_batch_tokens)
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or null (the whole draft vocabulary), got {top_k}")
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        if ttt_steps < 1 or not 0 < decay <= 1:
            raise ValueError(f"need ttt_steps >= 1 and 0 < decay <= 1, got ttt_steps={ttt_steps}, decay={decay}")
        check_fits(target.config.get_text_config().hidden_size, vocab.target_vocab_size, target, source="being trained")
        config = Eagle3Config.for_target(target.config, vocab.size, aux_layer_ids, norm_aux)
        self.drafter = Eagle3Drafter(config, vocab)
        if init_from_target:
            self.drafter.init_from_target(target)
        if freeze_lm_head:
            if not init_from_target:
                raise ValueError("freeze_lm_head=true keeps the target's rows: it needs init_from_target=true")
            self.drafter.lm_head.weight.requires_grad_(False)
        layers = target.config.get_text_config().num_hidden_layers
        if (index := layer_index(init_layer_from_target, config.aux_layer_ids, layers)) is not None:
            self.drafter.init_layer_from_target(target, index, tuple(init_embedding_from_feature or ()))
        elif init_embedding_from_feature:
            raise ValueError("init_embedding_from_feature copies the started layer's weights: it needs a layer from "
                             "the target (init_layer_from_target)")  # fmt: skip
        self.ttt_steps, self.decay, self.train_on, self.vocab_check = ttt_steps, decay, train_on, vocab_check
        self.loss_fn = loss_function(loss)
        self.top_k = min(top_k or vocab.size, vocab.size)
        self.save_hyperparameters(
            {
                "drafter": "eagle3",
                "target": target_name,
                "ttt_steps": ttt_steps,
                "decay": decay,
                "vocab": vocab.size,
                "top_k": self.top_k,
                "loss": loss,
                "train_on": train_on,
                "vocab_check": vocab_check,
                "freeze_lm_head": freeze_lm_head,
                "init_embedding_from_feature": list(init_embedding_from_feature or ()),
            }
        )
        names = [f"{m}_depth{d}" for d in range(1, ttt_steps + 1) for m in ("loss", "acc_top1", "acc_top4")]
        # the accuracies count only rows whose target argmax is a draft token (EAGLE-3's rule); vocab_coverage is the
        # share of supervised rows that are, so drafters with different vocabularies compare by acc x coverage
        self.val_metrics = nn.ModuleDict({name: MeanMetric() for name in [*names, "loss", "vocab_coverage"]})

    @classmethod
    def from_config(cls, cfg, target, **shared) -> "Eagle3Module":
        """The module of `cfg.drafter` (conf/drafter/eagle3.yaml), its draft vocabulary counted on the training split
        of `cfg.data`."""
        vocab_size = target.config.get_text_config().vocab_size
        data = cfg.data
        vocab = draft_vocab_from_training_split(
            data.dir, int(cfg.drafter.draft_vocab_size), vocab_size, data.val_fraction, data.split_seed
        )
        return instantiate(cfg.drafter.module, vocab=vocab, target=target, **shared, _convert_="object")

    def drafter_meta(self) -> dict:
        return {
            "config": self.drafter.config.to_dict(),
            "draft_token_ids": self.drafter.token_ids.tolist(),
        }

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.drafter.config.aux_layer_ids

    # ---- steps --------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, per_step, accuracy, _ = self._forward(batch, training=True)
        size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=size)
        for j in range(self.ttt_steps):
            hits, _, count = accuracy[j]
            self.log(f"train/loss_depth{j + 1}", per_step[j], batch_size=size)
            self.log(f"train/acc_top1_depth{j + 1}", hits / count.clamp(min=1), batch_size=size)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, per_step, accuracy, (labelled, supervised) = self._forward(batch, training=False)
        self.val_metrics["loss"].update(loss)
        self.val_metrics["vocab_coverage"].update(labelled / supervised.clamp(min=1), weight=supervised)
        for j in range(self.ttt_steps):
            hits, hits4, count = accuracy[j]
            self.val_metrics[f"loss_depth{j + 1}"].update(per_step[j], weight=count)
            self.val_metrics[f"acc_top1_depth{j + 1}"].update(hits / count.clamp(min=1), weight=count)
            self.val_metrics[f"acc_top4_depth{j + 1}"].update(hits4 / count.clamp(min=1), weight=count)

    def on_validation_epoch_end(self) -> None:
        top1 = [self.val_metrics[f"acc_top1_depth{j + 1}"] for j in range(self.ttt_steps)]
        if all(m.update_count for m in top1):
            self.log("val/sim_tau_chain", simulated_tau([m.compute() for m in top1]))
        super().on_validation_epoch_end()

    def _forward(self, batch: dict, training: bool = False):
        """Returns (weighted loss, loss per step [S], [(top-1 hits, top-4 hits, labelled rows)] per step, (labelled
        rows, supervised rows) of the batch): labelled rows are the supervised ones (`_wanted`) whose target argmax
        is a draft token."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B, T]
        wanted = self._wanted(batch, training)  # [B, T]
        out = self._target_outputs(batch, wanted)
        aux, labelled = out["aux"], out["labelled"]  # [B, T, n*h], [B, T]
        if not labelled.any():
            raise ValueError(
                f"batch of rows {batch['index'].tolist()} has no supervised token whose target argmax is in "
                f"the draft vocabulary: the loss would be 0; check the loss_mask of the data and the vocabulary size"
            )
        batch_size, width = input_ids.shape
        positions = torch.arange(width, device=input_ids.device)[None].expand(batch_size, -1)  # [B, T]
        embed = self.target.get_input_embeddings()
        feature = self.drafter.fuse(aux.to(self.drafter.fc.weight.dtype))  # [B, T, h]
        cache = DynamicCache()
        losses, accuracy = [], []
        for j in range(self.ttt_steps):
            embeds = embed(shift_left(input_ids, 1 + j)).to(feature.dtype)  # token t + 1 + j
            state = self.drafter(feature, embeds, positions + j, unrolled_mask(attention_mask, j), cache)
            valid = shift_left(labelled, 1 + j, fill=False)  # [B, T]: rows with a label at this step
            logits = self.drafter.logits(state[valid])  # [n, N]: only rows with a label pay the projection
            ids = shift_left(out["topk_ids"], 1 + j)[valid].long()  # [n, k]: the target after token t + 1 + j
            logp = shift_left(out["topk_logp"], 1 + j)[valid].float()  # [n, k]
            losses.append(self.loss_fn(logits, ids, logp))
            with torch.no_grad():
                top4 = logits.topk(min(4, logits.shape[-1]), dim=-1).indices  # [n, 4]
                hits4 = (top4 == ids[:, :1]).any(-1).sum()
                hits = (top4[:, 0] == ids[:, 0]).sum()
            accuracy.append((hits, hits4, valid.sum()))
            feature = state  # the next step reads the drafter's own output
        per_step = torch.stack(losses)  # [S]
        loss = (decay_weights(self.ttt_steps, self.decay, device=per_step.device) * per_step).sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} (per step {per_step.tolist()}) at step {self.global_step} on rows "
                f"{batch['index'].tolist()}: lower the learning rate or check the data and precision"
            )
        return loss, per_step.detach(), accuracy, (labelled.sum(), wanted.sum())
