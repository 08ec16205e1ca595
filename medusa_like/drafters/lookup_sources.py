"""The two lookup sources: what followed the current suffix earlier is a good guess of what follows now.

    ContextLookup   continuations found earlier in this generation's own prompt and output (prompt-lookup decoding,
                    with every distinct continuation a branch)
    OutputStore     the same over the target's earlier outputs (SuffixDecoding's global tree): every `generate` adds
                    its answer once it is done; bounded, oldest answers evicted first; saved and loaded

Both answer `candidates(history, depth)` from an n-gram index (`ngram_index.py`).
"""

import json
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from medusa_like.decoding.checks import check_integer
from medusa_like.io import existing_file, write_json
from medusa_like.targets import weights_fingerprint

from .base import DrafterMismatchError, target_name
from .ngram_index import MAX_MATCHES, MAX_NGRAM, SEPARATOR, Continuation, NgramIndex

STORE_FORMAT = "medusa_like.output_store"
STORE_VERSION = 2  # 2: keyed by the target's weights (`weights_fingerprint`), not its config
DEFAULT_STORE_TOKENS = 200_000  # an output store's bound when none is given: a few hundred answers


class ContextLookup:
    """Continuations found earlier in this generation's own prompt and output."""

    name = "context"

    def __init__(self, max_n: int = MAX_NGRAM, max_matches: int = MAX_MATCHES):
        self.max_n, self.max_matches = max_n, max_matches

    def begin(self, prompt_ids: list[int]) -> None:
        self.index = NgramIndex(self.max_n, self.max_matches)
        self.index.extend(prompt_ids)

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def candidates(self, history: list[int], depth: int) -> list[Continuation]:
        return self.index.continuations(history, depth)


class OutputStore:
    """The target's earlier outputs, at most `max_tokens` of them (the oldest answers are evicted first).

    An answer enters the store only through `add`, which `MedusaLikeModel.generate` calls when a generation is done:
    the answer being generated is never in it.
    """

    name = "store"

    def __init__(
        self,
        max_tokens: int = DEFAULT_STORE_TOKENS,
        max_n: int = MAX_NGRAM,
        max_matches: int = MAX_MATCHES,
        fingerprint: str | None = None,
    ):
        check_integer("an output store's max_tokens", max_tokens, 1)
        self.max_tokens, self.max_n, self.max_matches = max_tokens, max_n, max_matches
        self.fingerprint = fingerprint  # the target's whose outputs these are (None: not yet known)
        self.documents: deque[list[int]] = deque()
        self.num_tokens = 0
        self.index = NgramIndex(max_n, max_matches)

    def __len__(self) -> int:
        return len(self.documents)

    def add(self, tokens: list[int]) -> None:
        """Store one finished output; evict the oldest ones beyond `max_tokens` (a longer output keeps its end)."""
        tokens = [int(t) for t in tokens][-self.max_tokens :]
        if not tokens:
            return
        self.documents.append(tokens)
        self.num_tokens += len(tokens)
        if self.num_tokens > self.max_tokens:
            while (
                self.num_tokens > self.max_tokens * 3 // 4 and len(self.documents) > 1
            ):  # evict in bulk, re-index once
                self.num_tokens -= len(self.documents.popleft())
            self._reindex()
        else:
            self.index.extend([*tokens, SEPARATOR])

    def fill(self, documents: Iterable[list[int]], num_tokens: int) -> int:
        """Add `documents` (token-id lists) in order while they fit in `num_tokens` tokens, and never beyond
        `max_tokens`, so filling evicts nothing; returns how many were added (a global store seeded from a corpus,
        as SuffixDecoding seeds its tree)."""
        budget, added = min(num_tokens, self.max_tokens), 0
        for tokens in documents:
            if self.num_tokens + len(tokens) > budget:
                break
            if tokens:
                self.add(tokens)
                added += 1
        return added

    def contains(self, tokens: list[int]) -> bool:
        """Whether exactly this output is stored (tests use it to show no answer leaks into its own generation)."""
        return any(doc == list(tokens) for doc in self.documents)

    def begin(self, history: list[int]) -> None:
        pass  # outputs enter the store only when a generation is done (`add`)

    def extend(self, tokens: list[int]) -> None:
        pass

    def candidates(self, history: list[int], depth: int) -> list[Continuation]:
        return self.index.continuations(history, depth)

    def _reindex(self) -> None:
        self.index = NgramIndex(self.max_n, self.max_matches)
        for doc in self.documents:
            self.index.extend([*doc, SEPARATOR])

    # ---- files ----

    def save(self, path) -> Path:
        """Write the store as JSON, atomically (an interrupted save leaves the previous file whole)."""
        return write_json(
            path,
            {
                "format": STORE_FORMAT,
                "version": STORE_VERSION,
                "target_fingerprint": self.fingerprint,
                "max_tokens": self.max_tokens,
                "documents": list(self.documents),
            },
        )

    @classmethod
    def load(cls, path, target=None) -> "OutputStore":
        """A store written by `save`; with `target`, one made for another target is refused."""
        path = existing_file(path, "output store")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"output store {str(path)!r} is not JSON (truncated or corrupted?): {err}") from err
        if not isinstance(data, dict) or data.get("format") != STORE_FORMAT:
            raise ValueError(f"{str(path)!r} is not an output store: expected format {STORE_FORMAT!r}")
        if data.get("version") != STORE_VERSION:
            raise ValueError(
                f"output store {str(path)!r} has version {data.get('version')!r}, expected {STORE_VERSION}"
            )
        documents = data.get("documents")
        if not isinstance(documents, list) or not all(
            isinstance(doc, list) and all(isinstance(t, int) and t >= 0 for t in doc) for doc in documents
        ):
            raise ValueError(f"output store {str(path)!r}: 'documents' must be lists of token ids")
        max_tokens = data.get("max_tokens", DEFAULT_STORE_TOKENS)
        try:
            store = cls(max_tokens, fingerprint=data.get("target_fingerprint"))
        except (TypeError, ValueError) as err:
            raise ValueError(f"output store {str(path)!r}: {err}") from err
        for doc in documents:
            store.add(doc)
        if target is not None:
            store.check_fits(target, f"output store {str(path)!r}")
        return store

    @classmethod
    def seed(cls, path, tokenizer=None, **options) -> "OutputStore":
        """A store of the texts (JSON Lines of {"text": ...}, or plain text, one document per line; needs the
        target's `tokenizer`) or token-id lists (JSON Lines of lists) in `path`."""
        path = existing_file(path, "store seed file")
        store = cls(**options)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                item = line
            if isinstance(item, dict):
                item = item.get("text")
            if isinstance(item, str):
                if tokenizer is None:
                    raise ValueError(f"{path}:{number} is text: seeding from texts needs the target's tokenizer")
                item = tokenizer(item, add_special_tokens=False)["input_ids"]
            if not isinstance(item, list) or not all(isinstance(t, int) and t >= 0 for t in item):
                raise ValueError(f"{path}:{number}: expected a text or a list of token ids, got {str(item)[:60]!r}")
            store.add(item)
        return store

    def check_fits(self, target, source: str = "output store") -> None:
        """Refuse a store of another target's outputs (by its weights' fingerprint, when it has one: another
        checkpoint of one architecture answers otherwise) or with token ids beyond the target's vocabulary; a store
        without a fingerprint takes the target's."""
        actual = weights_fingerprint(target)
        if self.fingerprint is not None and self.fingerprint != actual:
            raise DrafterMismatchError(
                f"{source} holds outputs of a target with fingerprint {self.fingerprint}, but target "
                f"{target_name(target)!r} has fingerprint {actual}"
            )
        vocab = target.config.get_text_config().vocab_size
        largest = max((max(doc) for doc in self.documents), default=-1)
        if largest >= vocab:
            raise DrafterMismatchError(
                f"{source} holds token id {largest}, beyond target {target_name(target)!r}'s vocabulary of {vocab}"
            )
        self.fingerprint = actual
