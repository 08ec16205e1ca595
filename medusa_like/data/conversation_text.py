"""The `original` data recipe: the conversations' own answers, read by the target teacher-forced.

No generation: each conversation becomes one training row (the chat template over all its turns, cut at
`max_length` tokens) with the loss mask on the assistant's tokens. A drafter trained with soft labels (EAGLE-3) learns
the target's own distribution at those positions from one target forward per row, several times more supervised
tokens per CPU minute than answering the prompts first (`generation.py`). Rows are stored in chunks like distilled
ones (`storage.py`), with the same recipe check.
"""

from pathlib import Path

from medusa_like.data.masks import build_sample
from medusa_like.data.sources import load_conversations
from medusa_like.data.storage import CHUNK_SIZE, build_chunks, recipe


def select(source: str, num_conversations: int | None, split: str = "train") -> list[dict]:
    """The first `num_conversations` conversations of `source` that have an assistant answer."""
    selected = []
    for conv in load_conversations(source, split=split):
        if any(m["role"] == "assistant" for m in conv["messages"]):
            selected.append(conv)
        if num_conversations is not None and len(selected) >= num_conversations:
            break
    return selected


def conversation_row(tokenizer, conv: dict, max_length: int) -> dict:
    """One row: token ids and assistant loss mask of the whole conversation (up to its last answer), cut at
    `max_length`."""
    messages = conv["messages"]
    while messages and messages[-1]["role"] != "assistant":  # a trailing question teaches nothing
        messages = messages[:-1]
    answers = sum(m["role"] == "assistant" for m in messages)
    input_ids, loss_mask = build_sample(tokenizer, messages, [True] * answers)
    return {
        "id": conv["id"],
        "group": conv["group"],
        "input_ids": input_ids[:max_length],
        "loss_mask": loss_mask[:max_length],
    }


def run(
    model,
    tokenizer,
    conversations: list[dict],
    out_dir: str | Path,
    max_length: int,
    chunk_size: int = CHUNK_SIZE,
    target_name: str = "",
    source: str = "",
    progress: bool = True,
) -> Path | None:
    """Store the rows of every conversation (resumable, chunked); returns the dataset path."""
    made_of = recipe(model, conversations, "original", source, {"max_length": max_length}, chunk_size, target_name)

    def rows(chunk: list[dict], index: int, bar) -> list[dict]:
        out = [conversation_row(tokenizer, conv, max_length) for conv in chunk]
        if bar is not None:
            bar.update(len(chunk))
        return [row for row in out if sum(row["loss_mask"]) > 0]  # an answer cut off by max_length teaches nothing

    return build_chunks(out_dir, conversations, chunk_size, made_of, rows, progress=progress)
