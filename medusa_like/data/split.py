"""Deterministic train/validation split by conversation group.

A conversation is in validation when a hash of its group key falls below `val_fraction`: the decision depends on
nothing but the key and the seed, so it is stable across runs, shard counts, dataset sizes and orderings, and a
validation conversation is never trained on. A draft vocabulary is chosen from the training split alone
(`draft_vocab_from_training_split`), and so are the answers that seed a lookup store (`training_answers`), so
held-out prompts stay held out.

A conversation can be held out and still be seen: ShareGPT holds the same conversation under several ids, and the same
first prompt in many conversations. The split itself stays a hash of the group (moving such groups would change every
trained drafter's data); instead, `split_conversations` hands the evaluation the training split's texts
(`TrainingTexts`, compared by `text_key`), and the evaluation drops a validation prompt the training split also asks,
or whose conversation holds a training answer (see `evaluation.questions.load_validation_questions`).
"""

import hashlib
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from medusa_like.data.sources import load_conversations
from medusa_like.data.storage import load_distilled
from medusa_like.drafters.vocab import DraftVocab, count_tokens


def is_validation(group: str, val_fraction: float, seed: int = 0) -> bool:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def normalise_text(text: str) -> str:
    """`text` casefolded, its whitespace runs collapsed to one space, punctuation and spaces stripped at both ends:
    what makes two prompts the same prompt ("Continue!" and " continue" are)."""
    text = " ".join(text.casefold().split())
    start, end = 0, len(text)
    while start < end and _strippable(text[start]):
        start += 1
    while end > start and _strippable(text[end - 1]):
        end -= 1
    return text[start:end]


def _strippable(char: str) -> bool:
    return char.isspace() or unicodedata.category(char).startswith("P")


def text_key(text: str) -> bytes:
    """A short digest of `normalise_text(text)`: sets of keys stand for the split's texts at a fraction of their
    size."""
    return hashlib.blake2b(normalise_text(text).encode(), digest_size=16).digest()


@dataclass
class TrainingTexts:
    """The training split's texts, as `text_key`s: every user turn, and every assistant answer (what seeds a lookup
    store, `training_answers`)."""

    user_turns: set[bytes] = field(default_factory=set)
    answers: set[bytes] = field(default_factory=set)

    def add(self, conversation: dict) -> None:
        for message in conversation["messages"]:
            if message["role"] == "user":
                self.user_turns.add(text_key(message["content"]))
            elif message["role"] == "assistant":
                self.answers.add(text_key(message["content"]))


def split_conversations(source: str, val_fraction: float, split_seed: int = 0) -> tuple[list[dict], TrainingTexts]:
    """One pass over `source`: its validation conversations, in order, and the training split's texts."""
    validation, training = [], TrainingTexts()
    for conv in load_conversations(source):
        if is_validation(conv["group"], val_fraction, split_seed):
            validation.append(conv)
        else:
            training.add(conv)
    return validation, training


def training_answers(source: str, val_fraction: float, split_seed: int = 0) -> Iterator[str]:
    """The assistant answers of `source`'s training-split conversations, in order (a data config's `source`,
    `val_fraction` and `split_seed`): text that may seed a lookup store without leaking a validation conversation."""
    for conv in load_conversations(source):
        if is_validation(conv["group"], val_fraction, split_seed):
            continue
        for message in conv["messages"]:
            if message["role"] == "assistant" and message["content"].strip():
                yield message["content"]


def split_token_counts(
    data_dir: str | Path, vocab_size: int, val_fraction: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token [V] is supervised (an assistant token) in the training and in the validation split of a
    dataset: a draft vocabulary is chosen from the former alone, so held-out prompts stay held out."""
    rows = load_distilled(data_dir).select_columns(["input_ids", "loss_mask", "group"])
    held_out = [is_validation(g, val_fraction, seed) for g in rows["group"]]
    pairs = list(zip(rows["input_ids"], rows["loss_mask"], strict=True))
    train = count_tokens((p for p, v in zip(pairs, held_out, strict=True) if not v), vocab_size)
    validation = count_tokens((p for p, v in zip(pairs, held_out, strict=True) if v), vocab_size)
    return train, validation


def draft_vocab_from_training_split(
    data_dir: str | Path, size: int, vocab_size: int, val_fraction: float, split_seed: int = 0
) -> DraftVocab:
    """The `size` most frequent assistant tokens of the training split of the dataset in `data_dir` (a data config's
    `dir`), out of the target's `vocab_size`: the draft vocabulary of an EAGLE-3 drafter or of Medusa heads."""
    if not data_dir:
        raise ValueError(f"a draft vocabulary of {size} tokens needs the training data directory, got {data_dir!r}")
    counts, _ = split_token_counts(data_dir, vocab_size, val_fraction, split_seed)
    return DraftVocab.from_counts(counts, size)
