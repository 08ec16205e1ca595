"""The reduced draft vocabulary (FR-Spec; EAGLE-3's `d2t` / `t2d`): the N target tokens a drafter may propose.

A drafter's own projection scores only these N tokens, which is most of its cost on a small target (SmolLM2's full
projection is 49,152 x 576). They are the N most frequent target tokens at the supervised (assistant) positions of the
training data, kept in id order. Draft index i stands for target token `token_ids[i] = i + d2t[i]`; `t2d` marks the
chosen tokens in the full vocabulary. A token outside the set is never proposed; verification is the target's own, so
the output stays lossless whatever the set.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch


class DraftVocabError(ValueError):
    pass


@dataclass(frozen=True)
class DraftVocab:
    token_ids: torch.Tensor  # [N] long, strictly increasing target ids
    target_vocab_size: int

    def __post_init__(self):
        ids = self.token_ids
        if ids.dim() != 1 or ids.numel() == 0:
            raise DraftVocabError(f"a draft vocabulary needs a non-empty 1-d list of token ids, got {tuple(ids.shape)}")
        if ids.dtype != torch.long:
            raise DraftVocabError(f"draft token ids must be int64, got {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.target_vocab_size:
            raise DraftVocabError(
                f"draft token ids must lie in [0, {self.target_vocab_size}), got {int(ids.min())}..{int(ids.max())}"
            )
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise DraftVocabError("draft token ids must be strictly increasing (sorted, no duplicates)")

    @property
    def size(self) -> int:
        return self.token_ids.numel()

    @property
    def d2t(self) -> torch.Tensor:
        """[N] int64 offsets: target id = i + d2t[i]."""
        return self.token_ids - torch.arange(self.size, device=self.token_ids.device)

    @property
    def t2d(self) -> torch.Tensor:
        """[V] bool: which target tokens are in the draft vocabulary."""
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool, device=self.token_ids.device)
        mask[self.token_ids] = True
        return mask

    @classmethod
    def full(cls, vocab_size: int) -> "DraftVocab":
        return cls(torch.arange(vocab_size), vocab_size)

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int) -> "DraftVocab":
        """The `size` most frequent tokens of `counts` [V] (ties to the lower id), in id order."""
        if not isinstance(size, int) or size < 1:
            raise DraftVocabError(f"draft vocabulary size must be a positive integer, got {size!r}")
        vocab = counts.numel()
        size = min(size, vocab)
        order = torch.sort(-counts.double(), stable=True).indices[:size]
        return cls(order.sort().values.long(), vocab)

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, t2d: torch.Tensor) -> "DraftVocab":
        """Rebuild from EAGLE-3's maps, checking that they describe the same set."""
        if t2d.dtype != torch.bool or t2d.dim() != 1:
            raise DraftVocabError(f"t2d must be a 1-d bool mask over the target vocabulary, got {t2d.dtype}")
        if d2t.dim() != 1 or d2t.dtype not in (torch.int64, torch.int32):
            raise DraftVocabError(f"d2t must be 1-d int64 offsets, got {tuple(d2t.shape)} {d2t.dtype}")
        ids = d2t.long() + torch.arange(d2t.numel(), device=d2t.device)
        vocab = cls(ids, t2d.numel())
        if int(t2d.sum()) != vocab.size or not bool(t2d[ids].all()):
            raise DraftVocabError(
                f"d2t and t2d disagree: d2t names {vocab.size} target tokens, t2d marks {int(t2d.sum())}, "
                f"{int((~t2d[ids]).sum())} of d2t's tokens are not marked in t2d"
            )
        return vocab


def count_tokens(rows: Iterable[tuple[list[int], list[int]]], vocab_size: int) -> torch.Tensor:
    """Token counts [V] over the supervised positions of (input_ids, loss_mask) rows."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in rows:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        mask = torch.as_tensor(loss_mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts
