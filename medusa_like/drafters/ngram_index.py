"""The n-gram index both lookup sources (`lookup_sources.py`) answer from: a growing token sequence with the
positions after every n-gram of it, and the trie of continuations of the longest suffix that occurred earlier. Each
trie node carries how often it followed its parent (`Continuation.frequency`) and the match length, which
`drafters/calibration.py` turns into a calibrated chance of acceptance.
"""

from dataclasses import dataclass

SEPARATOR = -1  # between documents of a store: no n-gram or continuation crosses it
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
