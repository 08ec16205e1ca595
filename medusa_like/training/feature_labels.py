"""What the Lightning modules of drafters that read the target's fused features and learn its distribution share
(EAGLE-3's, the block drafter's): the target's side of a batch, computed once per row and cached or memoised.

From one frozen target forward per batch: the `aux` hidden states at the drafter's `feature_layers` (its input), and
the labels, the target's distribution over the draft vocabulary kept as its `top_k` most likely tokens (`topk_ids`,
`topk_logp`), at the positions that get one (`labelled`: those predicting an assistant token, or every real token with
`train_on="all"`, and with the vocabulary check only those whose target argmax is a draft token: EAGLE-3's rule). The
subclass names its drafter (with `token_ids`), `feature_layers`, `top_k`, `train_on` and `vocab_check`; two drafters
of the same draft vocabulary, feature layers, k and labelled positions read the same target cache.
"""

import torch

from medusa_like.targets import output_logits
from medusa_like.training.drafter_module import DrafterModule
from medusa_like.training.target_cache import vocab_digest
from medusa_like.training.ttt import supervised_rows

TRAIN_ON = ("assistant", "all")  # the positions labelled in training (`train_on`)
_PROJECTION_ROWS = 1024  # positions per chunk of the target's full projection (bounds memory: 1024 x V floats)


class FeatureLabelsModule(DrafterModule):
    feature_layers: tuple[int, ...]  # the target's hidden_states the drafter reads
    top_k: int  # labels: the target's k most likely draft tokens
    train_on: str  # one of TRAIN_ON
    vocab_check: bool  # training leaves out rows whose target argmax is not a draft token

    # ---- the target's side, once ------------------------------------------------------------------------------
    def cache_content(self) -> dict:
        """The cache holds the aux states and the labels: they depend on the draft vocabulary, the feature layers, k
        and the positions labelled (`train_on`: a cache labelled at the assistant's tokens only is never read by a run
        that trains on every token). It is always built with the vocabulary check (`vocab_check` is training's)."""
        return {
            "fields": ["aux", "topk_ids", "topk_logp", "labelled"],
            "draft_vocab": vocab_digest(self.drafter.token_ids),
            "aux_layer_ids": [int(i) for i in self.feature_layers],
            "top_k": int(self.top_k),
            "train_on": self.train_on,
        }

    @torch.no_grad()
    def cacheable_outputs(self, batch: dict) -> dict[str, torch.Tensor]:
        out = self._compute_target_outputs(batch, self._wanted(batch, training=True))
        ids = out["topk_ids"].to(torch.int16 if self.drafter.token_ids.numel() <= 2**15 else torch.int32)
        return {
            "aux": out["aux"].to(torch.bfloat16),
            "topk_ids": ids,
            "topk_logp": out["topk_logp"].to(torch.float16),
            "labelled": out["labelled"],
        }

    def _wanted(self, batch: dict, training: bool) -> torch.Tensor:
        """[B, T] bool: the positions that get a label: those predicting an assistant token, or with `train_on="all"`
        in training (and in the target cache, which serves both) every position predicting a real token."""
        mask = batch["attention_mask"] if training and self.train_on == "all" else batch["loss_mask"]
        return supervised_rows(mask, batch["attention_mask"])

    @torch.no_grad()
    def _target_outputs(self, batch: dict, wanted: torch.Tensor) -> dict[str, torch.Tensor]:
        """The target's side of a batch (see `_compute_target_outputs`), from the target cache when there is one, or
        in training from the memo of the latest rows when it holds them all (data echoing), labelled at the `wanted`
        positions only (the cache holds training's labels, a superset of validation's)."""
        vocab_check = self.vocab_check or not self.training  # validation keeps EAGLE-3's rule
        out = dict(self.read_target(batch, lambda b: self._compute_target_outputs(b, wanted, vocab_check)))
        out["labelled"] = out["labelled"].bool() & wanted
        return out

    @torch.no_grad()
    def _compute_target_outputs(
        self, batch: dict, wanted: torch.Tensor, vocab_check: bool = True
    ) -> dict[str, torch.Tensor]:
        """The target's side of a batch: `aux` hidden states [B, T, n*h]; at the `wanted` [B, T] positions (zero
        elsewhere) its `top_k` most likely draft tokens `topk_ids` [B, T, k] with their log-probabilities
        `topk_logp` [B, T, k] under the target's distribution restricted to the draft vocabulary, most likely first;
        and which positions are `labelled` [B, T]: wanted, and with `vocab_check` the target's argmax over its full
        vocabulary is a draft token (EAGLE-3's rule; without it only the draft vocabulary's logits are computed)."""
        hidden = self.target_hidden(batch, self.feature_layers)  # [B, T, (n+1)*h]
        size = self.target.config.get_text_config().hidden_size
        aux, last = hidden[..., :-size], hidden[..., -size:]
        rows = self.drafter.token_ids
        logps, ids, in_vocab = [], [], []
        for chunk in last[wanted].split(_PROJECTION_ROWS):  # [n, h]
            if vocab_check:
                full = output_logits(self.target, chunk).float()  # [n, V]: soft-capped as the target decodes
                draft = full[:, rows]  # [n, N]
                in_vocab.append(self.drafter_vocab_mask[full.argmax(-1)])
            else:
                draft = output_logits(self.target, chunk, rows).float()  # [n, N]
                in_vocab.append(torch.ones_like(draft[:, 0], dtype=torch.bool))
            top = draft.log_softmax(-1).topk(self.top_k, dim=-1)  # [n, k]
            logps.append(top.values)
            ids.append(top.indices)
        topk_logp = last.new_zeros(*last.shape[:-1], self.top_k, dtype=torch.float32)  # [B, T, k]
        topk_ids = torch.zeros(*last.shape[:-1], self.top_k, dtype=torch.long, device=last.device)  # [B, T, k]
        labelled = torch.zeros_like(wanted)
        if logps:
            topk_logp[wanted] = torch.cat(logps)
            topk_ids[wanted] = torch.cat(ids)
            labelled[wanted] = torch.cat(in_vocab)
        return {"aux": aux, "topk_ids": topk_ids, "topk_logp": topk_logp, "labelled": labelled}

    @property
    def drafter_vocab_mask(self) -> torch.Tensor:
        if getattr(self, "_t2d", None) is None or self._t2d.device != self.device:
            self._t2d = self.drafter.vocab.t2d.to(self.device)
        return self._t2d
