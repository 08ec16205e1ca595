"""The Lightning module for the block drafter (`drafters/block.py`): a frozen target, a trainable drafter of a few
layers, and a loss over every position of many blocks drafted from one read of the target.

Each row gets `anchors` block starts a: the block is the row's token a (the root, as the last verified token is at
inference) and B - 1 masks at positions a + 1 .. a + B - 1; its context is the target's fused features at the
positions before a, exactly what the drafter's cache holds when it drafts after a prefix ending at a - 1. Position j
of the block is trained on the target's own distribution after token a + j - 1 (the labels of `feature_labels.py`,
the same top-k soft labels, losses and target cache as EAGLE-3's), its loss weighted `decay ** (j - 1)`. Every block of
a batch is one forward: the rows' context keys are computed once, and each block row sees the context before its
anchor and its own block (`drafters/block.BlockMask`: attention that never forms the other blocks' pairs). So one read of the target supervises `anchors * (B - 1)` positions
a row, where EAGLE-3 supervises each read position once per unrolled step.

With the predecessor head (`predecessor_rank`), position j's logits are rescored by the true token before it (the
root at j = 1), as a chain that got there drafted it: teacher forcing.

Validation reports each position's top-1 accuracy (`val/acc_top1_pos{j}`), the share of blocks whose draft at j is
right among those right at every earlier position and labelled at j (`val/accept_pos{j}`: a chain's acceptance at j
given it got there) and the acceptance length of a chain (`val/sim_tau_chain` = 1 + sum_j prod_{i <= j} accept_i, as
EAGLE-3's), by which the best checkpoint is chosen.
Training samples anchors at random among the labelled positions; validation spreads them evenly over its rows, so its
figures do not move between evaluations.
"""

import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from hydra.utils import instantiate
from torchmetrics import MeanMetric

from medusa_like.data.split import draft_vocab_from_training_split
from medusa_like.drafters.base import check_fits
from medusa_like.drafters.block import BLOCK, DEFAULT_BLOCK_SIZE, BlockConfig, BlockDrafter
from medusa_like.drafters.block_attention import BlockMask
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.training.feature_labels import TRAIN_ON, FeatureLabelsModule
from medusa_like.training.losses import DECAY, decay_weights
from medusa_like.training.target_cache import BATCH_TOKENS
from medusa_like.training.ttt import loss_function, simulated_tau

log = logging.getLogger(__name__)


def block_visibility(anchors: torch.Tensor, attention_mask: torch.Tensor, size: int) -> BlockMask:
    """anchors [B, N] (block starts), attention_mask [B, T] -> which keys the N blocks' rows see: each row of block n
    the real context positions before its anchor, and every row of its own block."""
    positions = torch.arange(attention_mask.shape[1], device=anchors.device)
    context = (positions[None, None] < anchors[..., None]) & attention_mask.bool()[:, None]  # [B, N, T]
    return BlockMask(context.repeat_interleave(size, dim=1), size)  # [B, N * size, T]


def sample_anchors(valid: torch.Tensor, count: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """valid [B, T] bool (positions that may start a block) -> [B, count] block starts in order, -1 where a row has
    fewer: `count` of each row's valid positions, at random with `generator`, or evenly spread without one."""
    batch, width = valid.shape
    if generator is not None:
        score = torch.rand(batch, width, generator=generator).to(valid.device).masked_fill(~valid, -1.0)
    else:  # the valid positions of ranks (k + 1/2) n / count, k = 0 .. count - 1, for a row of n valid positions
        rank = valid.long().cumsum(-1) - 1  # [B, T]: each valid position's index among its row's
        total = valid.sum(-1, keepdim=True)  # [B, 1]
        wanted = ((torch.arange(count, device=valid.device) + 0.5) * total / count).long()  # [B, count]
        chosen = (rank[..., None] == wanted[:, None, :]).any(-1) & valid  # [B, T]
        score = chosen.float().masked_fill(~chosen, -1.0)
    top = score.topk(min(count, width), dim=-1)
    starts = top.indices.masked_fill(top.values < 0, -1)
    if starts.shape[1] < count:
        starts = torch.cat([starts, starts.new_full((batch, count - starts.shape[1]), -1)], dim=1)
    return starts.sort(dim=-1).values


class BlockModule(FeatureLabelsModule):
    kind = BLOCK.name
    checkpoint_prefix = "drafter"
    progress_metric = "acc_top1_pos1"

    def __init__(
        self,
        target: nn.Module,
        vocab: DraftVocab,
        target_name: str,
        optimizer: Callable,  # partial(torch.optim.AdamW, lr=...) from Hydra (`_partial_: true`)
        scheduler: Callable | None = None,  # partial(schedule, ...): (optimizer, total_steps=[, time_spent=])
        feature_layers: list[int] | None = None,  # null: the residual streams entering layers 2, L/2 and L-3
        block_size: int = DEFAULT_BLOCK_SIZE,  # B: the root and B - 1 drafted positions
        num_layers: int = 1,
        anchors: int = 32,  # blocks per row and step
        decay: float = DECAY,  # block position j's loss is weighted decay^(j - 1)
        mask_token_id: int | None = None,  # the target's mask token; null: a learned mask embedding
        predecessor_rank: int = 0,  # the predecessor head's rank (DSpark's Markov head); 0: none
        init_from_target: bool = True,  # start lm_head, the final norm and the mask embedding from the target's
        freeze_lm_head: bool = False,  # keep lm_head at the target's rows, untrained (DFlash shares the target's)
        # a target layer index per drafter layer, or "high" (from the layer the highest feature stream enters): start
        # the layers from those target layers' weights
        init_layers_from_target: list[int] | str | None = None,
        top_k: int | None = 64,  # labels: the target's k most likely draft tokens (null: the whole draft vocabulary)
        loss: str = "soft_ce",  # per position: soft_ce, tv, lk or a weighted sum, `ttt.loss_function`
        train_on: str = "assistant",  # labels at the assistant's tokens, or "all" real tokens (validation: the former)
        vocab_check: bool = True,  # training leaves out rows whose target argmax is not a draft token (EAGLE-3's rule)
        target_cache_dir: str | None = None,  # compute the target's side once, before the first step, and reuse it
        target_cache_batch_tokens: int = BATCH_TOKENS,  # padded tokens per target forward while building the cache
    ):
        super().__init__(target, target_name, optimizer, scheduler, target_cache_dir, target_cache_batch_tokens)
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or null (the whole draft vocabulary), got {top_k}")
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        if anchors < 1 or not 0 < decay <= 1:
            raise ValueError(f"need anchors >= 1 and 0 < decay <= 1, got anchors={anchors}, decay={decay}")
        check_fits(target.config.get_text_config().hidden_size, vocab.target_vocab_size, target, source="being trained")
        config = BlockConfig.for_target(
            target.config, vocab.size, feature_layers, block_size, num_layers, mask_token_id, predecessor_rank
        )
        self.drafter = BlockDrafter(config, vocab)
        if init_from_target:
            self.drafter.init_from_target(target)
        if freeze_lm_head:
            if not init_from_target:
                raise ValueError("freeze_lm_head=true keeps the target's rows: it needs init_from_target=true")
            self.drafter.lm_head.weight.requires_grad_(False)
        if isinstance(init_layers_from_target, str) and init_layers_from_target != "high":
            raise ValueError(
                f"init_layers_from_target must be target layer indices, 'high' or null, got {init_layers_from_target!r}"
            )
        if init_layers_from_target is not None:
            layers = (
                init_layers_from_target if isinstance(init_layers_from_target, str) else list(init_layers_from_target)
            )
            self.drafter.init_layers_from_target(target, layers)
        self.anchors, self.decay, self.train_on, self.vocab_check = anchors, decay, train_on, vocab_check
        self.loss_fn = loss_function(loss)
        self.top_k = min(top_k or vocab.size, vocab.size)
        self.save_hyperparameters(
            {
                "drafter": self.kind,
                "target": target_name,
                "block_size": block_size,
                "num_layers": num_layers,
                "predecessor_rank": predecessor_rank,
                "anchors": anchors,
                "decay": decay,
                "vocab": vocab.size,
                "top_k": self.top_k,
                "loss": loss,
                "train_on": train_on,
                "vocab_check": vocab_check,
                "freeze_lm_head": freeze_lm_head,
                "init_layers_from_target": init_layers_from_target
                if isinstance(init_layers_from_target, (str, type(None)))
                else list(init_layers_from_target),
            }
        )
        drafted = range(1, block_size)
        names = [f"{m}_pos{j}" for j in drafted for m in ("loss", "acc_top1", "acc_top4", "accept")]
        self.val_metrics = nn.ModuleDict({name: MeanMetric() for name in [*names, "loss", "vocab_coverage"]})

    @classmethod
    def from_config(cls, cfg, target, **shared) -> "BlockModule":
        """The module of `cfg.drafter` (conf/drafter/block.yaml), its draft vocabulary counted on the training split
        of `cfg.data`."""
        vocab_size = target.config.get_text_config().vocab_size
        data = cfg.data
        vocab = draft_vocab_from_training_split(
            data.dir, int(cfg.drafter.draft_vocab_size), vocab_size, data.val_fraction, data.split_seed
        )
        return instantiate(cfg.drafter.module, vocab=vocab, target=target, **shared, _convert_="object")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.drafter.config.feature_layers

    def drafter_meta(self) -> dict:
        return {"config": self.drafter.config.to_dict(), "draft_token_ids": self.drafter.token_ids.tolist()}

    # ---- steps --------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, per_position, accuracy, _ = self._forward(batch, training=True)
        size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=size)
        for j, (hits, _, _, count) in enumerate(accuracy, 1):
            self.log(f"train/loss_pos{j}", per_position[j - 1], batch_size=size)
            self.log(f"train/acc_top1_pos{j}", hits / count.clamp(min=1), batch_size=size)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, per_position, accuracy, (labelled, supervised) = self._forward(batch, training=False)
        self.val_metrics["loss"].update(loss)
        self.val_metrics["vocab_coverage"].update(labelled / supervised.clamp(min=1), weight=supervised)
        for j, (hits, hits4, (accepted, blocks), count) in enumerate(accuracy, 1):
            if count:
                self.val_metrics[f"loss_pos{j}"].update(per_position[j - 1], weight=count)
                self.val_metrics[f"acc_top1_pos{j}"].update(hits / count, weight=count)
                self.val_metrics[f"acc_top4_pos{j}"].update(hits4 / count, weight=count)
            if blocks:  # of the blocks right up to position j - 1 and labelled at j: the share right at j
                self.val_metrics[f"accept_pos{j}"].update(accepted / blocks, weight=blocks)

    def on_validation_epoch_end(self) -> None:
        accepts = [self.val_metrics[f"accept_pos{j}"] for j in range(1, self.drafter.config.block_size)]
        if accepts[0].update_count:  # 1 + sum_j prod_{i <= j} a_i, up to the last position measured (`simulated_tau`)
            measured = [
                m.compute() for m in accepts[: next((j for j, m in enumerate(accepts) if not m.update_count), None)]
            ]
            self.log("val/sim_tau_chain", simulated_tau(measured))
        super().on_validation_epoch_end()

    def _forward(self, batch: dict, training: bool = False):
        """Returns (weighted loss, loss per block position [B - 1], per position (top-1 hits, top-4 hits, (blocks
        right up to here, blocks right before here and labelled here), labelled rows), (labelled rows, supervised
        rows) of the batch)."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # [B, T]
        wanted = self._wanted(batch, training)  # [B, T]
        out = self._target_outputs(batch, wanted)
        labelled = out["labelled"]  # [B, T]
        if not labelled.any():
            raise ValueError(
                f"batch of rows {batch['index'].tolist()} has no supervised token whose target argmax is in "
                f"the draft vocabulary: the loss would be 0; check the loss_mask of the data and the vocabulary size"
            )
        drafter, size = self.drafter, self.drafter.config.block_size
        width = input_ids.shape[1]
        positions = torch.arange(width, device=input_ids.device)
        drafted = torch.arange(size - 1, device=input_ids.device)  # [B - 1]: block position j = 1 .. B - 1, minus 1
        starts = labelled & (positions >= 1)[None]  # a block may start at a >= 1 whose first position has a label
        generator = self._anchor_generator() if training else None
        anchors = sample_anchors(starts, self.anchors, generator)  # [B, N], -1: none
        real = anchors >= 0
        anchors = anchors.clamp(min=1)
        labels_at = anchors[..., None] + drafted  # [B, N, B - 1]: the label of position j sits at a + j - 1
        inside = labels_at < width
        labels_at = labels_at.clamp(max=width - 1)
        valid = real[..., None] & inside & labelled.gather(1, labels_at.flatten(1)).view_as(labels_at)

        state = self.block_states(out["aux"], input_ids, attention_mask, anchors)  # [B, N, B - 1, h]
        flat = labels_at.flatten(1)  # [B, N * (B - 1)]

        top = out["topk_ids"].shape[-1]
        ids = out["topk_ids"].gather(1, flat[..., None].expand(-1, -1, top)).view(*labels_at.shape, top)
        logp = out["topk_logp"].gather(1, flat[..., None].expand(-1, -1, top)).view(*labels_at.shape, top)
        # every block row's logits in one product of a fixed shape (per batch: B x anchors x (B_s - 1)), the rows
        # without a label included: oneDNN builds a kernel for each new shape it multiplies, and the count of labelled
        # rows changes every batch
        previous = input_ids.gather(1, flat).view_as(labels_at)  # [B, N, B - 1]: the true token before each position
        all_logits = drafter.logits(state, previous)  # [B, N, B_s - 1, N_draft]
        running = real.clone()  # [B, N]: blocks whose drafts so far are all right
        losses, accuracy = [], []
        for j in range(size - 1):
            rows = valid[:, :, j]  # [B, N]
            logits = all_logits[:, :, j][rows]  # [n, N_draft]
            row_ids, row_logp = ids[:, :, j][rows].long(), logp[:, :, j][rows].float()
            losses.append(self.loss_fn(logits, row_ids, row_logp))
            with torch.no_grad():
                top4 = logits.topk(min(4, logits.shape[-1]), dim=-1).indices  # [n, 4]
                right = torch.zeros_like(rows)
                right[rows] = top4[:, 0] == row_ids[:, 0]
                reached = running & rows  # blocks right so far with a label here: this draft decides their chain
                running = reached & right
                accuracy.append(
                    (right.sum(), (top4 == row_ids[:, :1]).any(-1).sum(), (running.sum(), reached.sum()), rows.sum())
                )
        per_position = torch.stack(losses)  # [B - 1]
        loss = (decay_weights(size - 1, self.decay, device=per_position.device) * per_position).sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite loss {loss.item()} (per position {per_position.tolist()}) at step {self.global_step} on "
                f"rows {batch['index'].tolist()}: lower the learning rate or check the data and precision"
            )
        return loss, per_position.detach(), accuracy, (labelled.sum(), wanted.sum())

    def block_states(self, aux, input_ids, attention_mask, anchors) -> torch.Tensor:
        """The drafted positions' output states [B, N, B_s - 1, h] of the blocks at `anchors` [B, N] (each >= 1), all
        in one forward: the rows' context from their features `aux` [B, T, n * h_t], each block seeing the real
        context positions before its anchor (what the drafter's cache holds at inference) and itself."""
        drafter, size = self.drafter, self.drafter.config.block_size
        batch_size, width = input_ids.shape
        positions = torch.arange(width, device=input_ids.device)[None].expand(batch_size, -1)  # [B, T]
        keys = drafter.context_keys(drafter.context(aux), positions)
        roots = input_ids.gather(1, anchors)  # [B, N]
        drafter.use_target_embeddings(self.target.get_input_embeddings())
        block = drafter.block_embeddings(self.target.get_input_embeddings()(roots)).flatten(1, 2)  # [B, N * B_s, h]
        block_positions = (anchors[..., None] + torch.arange(size, device=anchors.device)).flatten(1)  # [B, N * B_s]
        state = drafter(block, block_positions, keys, block_visibility(anchors, attention_mask, size))
        return state.view(batch_size, anchors.shape[1], size, -1)[:, :, 1:]

    def _anchor_generator(self) -> torch.Generator:
        """Training's anchors: drawn from a generator of the run's seed and the step, so a resumed run draws the same."""
        return torch.Generator().manual_seed(
            (int(torch.initial_seed()) * 1_000_003 + int(self.global_step)) % (1 << 63)
        )
