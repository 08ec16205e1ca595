"""How likely the target is to accept a drafted node: calibrated online, per bucket of what proposed it.

A node's raw estimate is its drafter probability (learned) or how often it followed its parent among the matches
(lookup). After each step the target's accepted path and bonus token tell, for every candidate whose parent was
accepted, whether the target agreed with it, verified or not; those outcomes update Beta counts per bucket (the set of
sources that proposed it, then its most confident proposal's source, raw-estimate, match-length and depth buckets),
whose mean (with that raw estimate as prior) is q = P(node accepted | parent accepted). A node two sources agree on is
far likelier than one either proposes alone at the same per-source estimate (docs/trees.md), so agreement is its own
bucket: pooled into each source's buckets, it would make single-source nodes look likelier than they are, and the
budget (`budget.py`) would verify too many of them.
"""

from bisect import bisect_right
from dataclasses import dataclass, field

LEARNED = "learned"  # the learned drafter's source name, beside lookup's sources

# Calibration bucket edges (`bisect_right`: a value equal to an edge falls in the bucket above it)
FREQUENCY_EDGES = (0.34, 0.67, 0.99)  # a lookup node's share of the matches
MATCH_LENGTH_EDGES = (2, 3, 4, 6, 9)  # the tokens its match spans
PROBABILITY_EDGES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.9)  # a learned node's probability
MAX_DEPTH_BUCKET = 4  # nodes this deep or deeper share a bucket


@dataclass
class Calibration:
    """P(node accepted | parent accepted) per bucket: Beta counts with each node's raw estimate as the prior mean."""

    prior_weight: float = 2.0
    hits: dict = field(default_factory=dict)
    trials: dict = field(default_factory=dict)

    def estimate(self, key: tuple, raw: float) -> float:
        return (self.hits.get(key, 0.0) + self.prior_weight * raw) / (self.trials.get(key, 0.0) + self.prior_weight)

    def update(self, key: tuple, hit: bool) -> None:
        self.trials[key] = self.trials.get(key, 0.0) + 1.0
        self.hits[key] = self.hits.get(key, 0.0) + float(hit)


def lookup_key(source: str, frequency: float, match_length: int, depth: int) -> tuple:
    return (
        source,
        bisect_right(FREQUENCY_EDGES, frequency),
        bisect_right(MATCH_LENGTH_EDGES, match_length),
        min(depth, MAX_DEPTH_BUCKET),
    )


def lookup_prior(frequency: float, match_length: int) -> float:
    """A raw guess before any outcome is seen: longer matches and more frequent continuations are likelier."""
    return frequency * min(0.9, 0.25 + 0.1 * match_length)


def learned_key(probability: float, depth: int) -> tuple:
    return (LEARNED, bisect_right(PROBABILITY_EDGES, probability), min(depth, MAX_DEPTH_BUCKET))
