"""Lookup drafting: no training, no weights. The target repeats its prompt and itself, so what followed the current
suffix earlier is a good guess of what follows now.

    context lookup   continuations of the longest suffix of prompt + output so far, found earlier in the same text
                     (prompt-lookup decoding, with every distinct continuation a branch)
    output store     the same over the target's earlier outputs (SuffixDecoding's global tree): every `generate`
                     adds its answer once it is done; bounded, oldest answers evicted first; saved and loaded

Both index their text by n-grams (`NgramIndex`) and answer a suffix with a trie of continuations: each node carries
how often it followed its parent (`Continuation.frequency`), and the match length, which `drafters/calibration.py` turns
into a calibrated chance of acceptance. A `LookupDrafter` (kind "lookup") is the two sources behind the combined
proposer with no learned drafter: `MedusaLikeModel.from_pretrained(target, drafter="lookup")`.
"""

import copy
import json
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_like.decoding.checks import check_integer
from medusa_like.io import existing_file, write_json
from medusa_like.targets import weights_fingerprint

from ..decoding.tree import DEFAULT_LOOKUP_DEPTH, TreeSpec, budgeted
from .base import DrafterMismatchError, target_name
from .kinds import TrainingFreeKind
from .merged_tree import MergedTreeProposer, SessionState

SEPARATOR = -1  # between documents of a store: no n-gram or continuation crosses it
STORE_FORMAT = "medusa_like.output_store"
STORE_VERSION = 2  # 2: keyed by the target's weights (`weights_fingerprint`), not its config
DEFAULT_STORE_TOKENS = 200_000  # an output store's bound when none is given: a few hundred answers
MAX_NGRAM = 4  # the longest n-gram a lookup source indexes
MAX_MATCHES = 16  # the most recent occurrences of a matched suffix whose continuations are read


@dataclass
class Continuation:
    """One trie node of looked-up continuations: the path of tokens after the root, how often this node followed its
    parent among the matches (0..1], and the match that found it."""

    path: tuple[int, ...]
    frequency: float
    match_length: int


class NgramIndex:
    """A growing token sequence with the positions after every n-gram of it (n <= `max_n`).

    `continuations(suffix, depth)` finds the longest suffix of `suffix` (up to `max_n` tokens, extended backwards
    up to `max_match` by comparing tokens) that occurred earlier, and returns the trie of what followed its most
    recent `max_matches` occurrences, `depth` tokens deep, without the paths followed by fewer than `min_share` of
    them (SuffixDecoding stops its paths at about 0.1 too).
    """

    def __init__(
        self, max_n: int = MAX_NGRAM, max_matches: int = MAX_MATCHES, max_match: int = 16, min_share: float = 0.1
    ):
        self.max_n, self.max_matches, self.max_match, self.min_share = max_n, max_matches, max_match, min_share
        self.tokens: list[int] = []
        # hash chains, as compressors index their window: per n, the position right after an n-gram's latest
        # occurrence, and for each position the one after the previous occurrence of the n-gram before it (-1: none)
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.previous: list[list[int]] = [[] for _ in range(max_n + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append `tokens`; index every n-gram that ends in them (it may start in the tokens before) and holds no
        SEPARATOR. One n at a time over zipped shifted views, into hash chains (no list per n-gram): a store is seeded
        with millions of tokens."""
        seq = self.tokens
        start = len(seq)
        seq.extend(tokens)
        for n in range(1, self.max_n + 1):
            latest, previous = self.latest[n], self.previous[n]
            previous.extend([-1] * (len(seq) + 1 - len(previous)))  # [len(seq) + 1]: one per end
            first = max(start - n + 1, 0)  # where the first n-gram ending in the new tokens starts
            window = seq[first:]
            for end, gram in enumerate(zip(*(window[k:] for k in range(n)), strict=False), first + n):
                if SEPARATOR not in gram:
                    previous[end] = latest.get(gram, -1)
                    latest[gram] = end

    def continuations(self, suffix: list[int], depth: int) -> list[Continuation]:
        """The trie of continuations of the longest matching suffix, parents before children (empty: no match)."""
        for n in range(min(self.max_n, len(suffix)), 0, -1):
            ends = self._recent_ends(tuple(suffix[-n:]))
            if ends:
                break
        else:
            return []
        seq = self.tokens
        match_length = max(self._match_length(suffix, e, n) for e in ends)
        counts: dict[tuple[int, ...], int] = {}
        for end in ends:
            path: tuple[int, ...] = ()
            for token in seq[end : end + depth]:
                if token == SEPARATOR:
                    break
                path += (token,)
                counts[path] = counts.get(path, 0) + 1
        total, reach, found = len(ends), {(): 1.0}, []
        for path, count in sorted(counts.items(), key=lambda item: len(item[0])):
            frequency = count / (counts[path[:-1]] if len(path) > 1 else total)
            parent = reach.get(path[:-1])
            if parent is not None and parent * frequency >= self.min_share:  # rare branches are not worth a node
                reach[path] = parent * frequency
                found.append(Continuation(path, frequency, match_length))
        return found

    def _recent_ends(self, gram: tuple[int, ...]) -> list[int]:
        """The last `max_matches` positions after `gram` that have a continuation (newest last)."""
        seq, found = self.tokens, []
        previous = self.previous[len(gram)]
        end = self.latest[len(gram)].get(gram, -1)
        while end >= 0:
            if end < len(seq) and seq[end] != SEPARATOR:
                found.append(end)
                if len(found) == self.max_matches:
                    break
            end = previous[end]
        return found[::-1]

    def _match_length(self, suffix: list[int], end: int, matched: int) -> int:
        """How many tokens before position `end` agree with the end of `suffix` (at least `matched`)."""
        seq, n = self.tokens, matched
        limit = min(self.max_match, len(suffix), end)
        while n < limit and seq[end - n - 1] == suffix[-n - 1]:
            n += 1
        return n


# ---------------------------------------------------------------------------------------------------------------------
# The two sources


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


# ---------------------------------------------------------------------------------------------------------------------
# The drafter and its kind


class LookupDrafter:
    """Context lookup and an output store, merged into one cost-aware tree (`drafters/merged_tree.py`) with no
    learned drafter. Lossless like any drafter; needs no training."""

    kind = "lookup"
    max_depth = None
    wants_cost_model = True  # its trees are budgeted by this machine's cost model

    def __init__(
        self,
        store: OutputStore | None = None,
        context: ContextLookup | None = None,
        lookup_depth: int = DEFAULT_LOOKUP_DEPTH,
        use: tuple[str, ...] = ("context", "store"),
    ):
        self.store = store if store is not None else OutputStore()
        self.context = context or ContextLookup()
        self.lookup_depth = lookup_depth
        unknown = set(use) - {"context", "store"}
        if unknown or not use:
            raise ValueError(f"lookup sources are 'context' and 'store', got {list(use)}")
        self.use = tuple(use)
        self.state = SessionState()  # calibration and cost model, kept across generations

    def sources(self) -> list:
        return [source for source in (self.context, self.store) if source.name in self.use]

    @property
    def cost_model(self):
        return self.state.cost_model

    def use_cost_model(self, cost) -> None:
        self.state.cost_model = cost

    def proposer(self, target) -> MergedTreeProposer:
        return MergedTreeProposer(target, None, self.sources(), self.state)

    def parts(self) -> dict:
        return {}

    def fork(self) -> "LookupDrafter":
        forked = copy.copy(self)
        forked.state = self.state.fork()
        return forked

    def check_fits(self, target) -> None:
        self.store.check_fits(target)

    def adapt_tree(self, spec: TreeSpec) -> TreeSpec:
        """Lookup fills no ranked tree: only the budget (nodes) and depth of `spec` are kept."""
        return budgeted(spec, lookup_depth=self.lookup_depth, keep_learned=False)

    def remember(self, tokens: list[int]) -> None:
        self.store.add(tokens)

    def to(self, device=None, dtype=None) -> "LookupDrafter":
        return self  # no tensors

    def eval(self) -> "LookupDrafter":
        return self

    def modules(self) -> Iterator[torch.nn.Module]:
        return iter(())


def fresh_lookup(
    target,
    store: str | Path | OutputStore | None = None,
    max_store_tokens: int = DEFAULT_STORE_TOKENS,
    lookup_depth: int = DEFAULT_LOOKUP_DEPTH,
    use: tuple[str, ...] = ("context", "store"),
) -> LookupDrafter:
    """Context lookup and an output store: empty, or loaded from `store` (a file `OutputStore.save` wrote);
    `use` picks the sources."""
    if isinstance(store, (str, Path)):
        store = OutputStore.load(store, target)
    elif store is None:
        store = OutputStore(max_store_tokens, fingerprint=weights_fingerprint(target))
    return LookupDrafter(store, lookup_depth=lookup_depth, use=tuple(use))


LOOKUP = TrainingFreeKind("lookup", fresh_lookup, "save and load its store with OutputStore.save / .load")
