"""One tree from several sources: a learned drafter (EAGLE-3 or Medusa heads) and lookup (context, output store),
merged by prefix, each node scored by an estimated chance of acceptance, cut to a cost-aware budget.

One step (`CombinedProposer.propose`):

    lookup      each source's trie of continuations after the text so far                   (no model: cheap)
    learned     the learned drafter's tree, unless steps without it, where lookup's best guess was as sure as now,
                gave more tokens per ms, measured end to end                     (EAGLE-3: one drafter pass per depth)
    merge       one trie keyed by token paths: two sources proposing the same prefix give one node
    score       q(node) = P(node accepted | parent accepted), calibrated online per source and bucket (below);
                score(node) = product of q along its path: the chance the target accepts it
    budget      the best n nodes by score, n maximising (1 + sum of their scores) / (verify_ms(n + 1) + draft_ms)
                from the machine's cost model (`decoding/cost_model.py`): shallow or none when little is likely,
                deep along a long confident match

Calibration: a node's raw estimate is its drafter probability (learned) or how often it followed its parent among
the matches (lookup). After each step the target's accepted path and bonus token tell, for every candidate whose
parent was accepted, whether the target agreed with it, verified or not; those outcomes update Beta counts per bucket
(the set of sources that proposed it, then its most confident proposal's source, raw-estimate, match-length and depth
buckets), whose mean (with that raw estimate as prior) is q. A node two sources agree on is far likelier than one
either proposes alone at the same per-source estimate (docs/trees.md), so agreement is its own bucket: pooled into
each source's buckets, it would make single-source nodes look likelier than they are, and the budget would verify too
many of them.

Scores are non-increasing along a path, so the best n nodes are ancestor-closed; the target verifies them like any
tree, and the output stays exactly the target's.
"""

import math
import time
from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from medusa_like.decoding.cost_cache import machine_cost_model
from medusa_like.decoding.cost_model import CostModel
from medusa_like.decoding.draft_tree import DraftTree
from medusa_like.decoding.tree import TreeSpec, budgeted

OVERHEAD_MS = 1.0  # per step outside drafting and the verification forward: acceptance, commits, Python
PROBE_EVERY = 8  # every this many steps the learned drafter's gate takes the side it judged slower, to keep it measured
STEP_WEIGHT = 0.05  # the weight of one step in the gate's moving averages of tokens and milliseconds per step
LEARNED = "learned"

# Calibration bucket edges (`bisect_right`: a value equal to an edge falls in the bucket above it)
FREQUENCY_EDGES = (0.34, 0.67, 0.99)  # a lookup node's share of the matches
MATCH_LENGTH_EDGES = (2, 3, 4, 6, 9)  # the tokens its match spans
PROBABILITY_EDGES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.9)  # a learned node's probability
MAX_DEPTH_BUCKET = 4  # nodes this deep or deeper share a bucket
CERTAINTY_EDGES = (0.05, 0.2, 0.5)  # the best lookup node's score, for the learned drafter's gate


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


@dataclass
class SessionState:
    """What a combined or lookup drafter learns across generations: calibration, the machine's cost model, and the
    learned drafter's measured time and gain."""

    cost_model: CostModel | None = None
    calibration: Calibration = field(default_factory=Calibration)
    learned_ms: float | None = None
    # per (bucket of lookup's best score (`lookup_certainty`), learned drafter run): moving averages of the tokens a
    # step gave and of its milliseconds from drafting to acceptance
    steps: dict[tuple[int, bool], list[float]] = field(default_factory=dict)

    def record(self, certainty: int, ran_learned: bool, tokens: int, ms: float) -> None:
        averages = self.steps.get((certainty, ran_learned))
        if averages is None:
            self.steps[certainty, ran_learned] = [float(tokens), ms]
        else:
            averages[0] = _ema(averages[0], tokens, STEP_WEIGHT)
            averages[1] = _ema(averages[1], ms, STEP_WEIGHT)

    def rate(self, certainty: int, ran_learned: bool) -> float | None:
        """Measured tokens per ms of steps in this bucket, with or without the learned drafter; None if none ran."""
        averages = self.steps.get((certainty, ran_learned))
        return None if averages is None else averages[0] / averages[1]


@dataclass
class Candidate:
    sources: int  # bitmask over the proposer's source names
    key: tuple  # the calibration bucket of its most confident proposal (`lookup_key`, `learned_key`)
    raw: float  # that proposal's raw estimate, the calibration's prior
    q: float = 0.0  # calibrated P(accepted | parent accepted), set by `CombinedProposer._calibrate`

    @property
    def bucket(self) -> tuple:
        """Where its outcomes are counted: the sources that proposed it, and its most confident proposal's bucket."""
        return (self.sources, *self.key)


class CombinedProposer:
    """The `Proposer` (drafters/protocol.py) of a combined or lookup drafter: `learned` (a drafter, or None) and
    lookup `sources` (objects with `name`, `begin(history)`, `extend(tokens)`, `candidates(history, depth)`);
    `state` is what outlives one generation."""

    def __init__(self, target, learned, sources: list, state: SessionState):
        self.learned = learned.proposer(target) if learned is not None else None
        self.sources = sources
        self.source_names = tuple(s.name for s in self.sources) + ((LEARNED,) if self.learned else ())
        self.feature_layers = self.learned.feature_layers if self.learned else None
        self.max_depth = self.learned.max_depth if self.learned else None
        self.max_rank = self.learned.max_rank if self.learned else None
        self.state = state
        self.calibration = state.calibration
        self.cost = cost_model_for(state, target)

    # ---- the protocol ----

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor, root: torch.Tensor, capacity: int) -> None:
        self.history = [*prompt_ids.tolist(), int(root)]
        for source in self.sources:
            source.begin(self.history)
        if self.learned:
            self.learned.begin(prompt_ids, features, root, capacity)
        self.root, self.step, self.last, self.timed = root, 0, None, None

    def propose(self, spec: TreeSpec) -> DraftTree:
        spec = budgeted(spec)
        begun = start = time.perf_counter()
        candidates: dict[tuple[int, ...], Candidate] = {}
        for bit, source in enumerate(self.sources):
            for c in source.candidates(self.history, spec.lookup_depth):
                key = lookup_key(source.name, c.frequency, c.match_length, len(c.path))
                self._add(candidates, c.path, bit, key, lookup_prior(c.frequency, c.match_length))
        self._calibrate(candidates)
        lookup_ms = 1000 * (time.perf_counter() - start)
        certainty = lookup_certainty(path_scores(candidates))
        ran_learned = self.learned is not None and spec.learned is not None and self._learned_pays(certainty)
        if ran_learned:
            start = time.perf_counter()
            tree = self.learned.propose(spec.learned)
            self.state.learned_ms = _ema(self.state.learned_ms, 1000 * (time.perf_counter() - start))
            self._add_learned(candidates, tree)
            self._calibrate(candidates)
        scores = path_scores(candidates)
        draft_ms = lookup_ms + (self.state.learned_ms if ran_learned else 0.0)
        count, _ = best_rate(scores, self.cost, draft_ms, spec.num_nodes)
        chosen = sorted(scores, key=lambda p: (-scores[p], len(p)))[:count]
        self.last, self.timed = candidates, (certainty, ran_learned, begun)
        self.step += 1
        return self._compile(sorted(chosen, key=len), candidates)

    def accept(self, tokens: torch.Tensor, features: torch.Tensor, bonus: torch.Tensor) -> None:
        truth = [*tokens[1:].tolist(), int(bonus)]  # what the target produced after the root
        if self.timed:
            certainty, ran_learned, begun = self.timed
            self.state.record(certainty, ran_learned, len(truth), 1000 * (time.perf_counter() - begun))
        if self.last:
            for path, candidate in self.last.items():
                depth = len(path)
                if depth <= len(truth) and list(path[:-1]) == truth[: depth - 1]:
                    self.calibration.update(candidate.bucket, path[-1] == truth[depth - 1])
        self.history.extend(truth)
        for source in self.sources:
            source.extend(truth)
        if self.learned:
            self.learned.accept(tokens, features, bonus)
        self.root = bonus

    # ---- the pieces ----

    def _add(self, candidates: dict, path: tuple, bit: int, key: tuple, raw: float) -> None:
        found = candidates.get(path)
        if found is None:
            candidates[path] = Candidate(1 << bit, key, raw)
        else:
            found.sources |= 1 << bit
            if raw > found.raw:
                found.key, found.raw = key, raw

    def _calibrate(self, candidates: dict) -> None:
        for candidate in candidates.values():
            candidate.q = self.calibration.estimate(candidate.bucket, candidate.raw)

    def _add_learned(self, candidates: dict, tree: DraftTree) -> None:
        bit = len(self.sources)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        logp = tree.logp.tolist() if tree.logp is not None else [0.0] * len(tokens)
        paths: list[tuple[int, ...]] = [()]
        for i in range(1, len(tokens)):
            path = paths[parents[i]] + (tokens[i],)
            paths.append(path)
            probability = math.exp(min(logp[i] - logp[parents[i]], 0.0))
            self._add(candidates, path, bit, learned_key(probability, len(path)), probability)

    def _learned_pays(self, certainty: int) -> bool:
        """Run the learned drafter where steps that ran it, when lookup was as sure of its best guess, gave more
        tokens per ms than steps that did not: measured from drafting to acceptance, so its drafting, the nodes it
        adds to verification and its misjudged estimates all count. A side never measured is tried first; every
        PROBE_EVERY steps the other side is taken. (Where the text repeats, lookup's drafts are likelier than the
        drafter's and it rarely pays; where nothing matches, it is the only source.)"""
        with_it, without = self.state.rate(certainty, True), self.state.rate(certainty, False)
        if with_it is None or without is None:
            return with_it is None
        return (with_it > without) != (self.step % PROBE_EVERY == 0)

    def _compile(self, paths: list[tuple[int, ...]], candidates: dict) -> DraftTree:
        device = self.root.device
        index = {(): 0}
        for i, path in enumerate(paths, 1):
            index[path] = i
        tokens = torch.tensor([int(self.root), *(p[-1] for p in paths)], dtype=torch.long, device=device)
        parents = torch.tensor([-1, *(index[p[:-1]] for p in paths)], dtype=torch.long, device=device)
        tree = DraftTree.from_parents(tokens, parents)
        tree.sources = torch.tensor([0, *(candidates[p].sources for p in paths)], dtype=torch.long)
        tree.source_names = self.source_names
        return tree


def path_scores(candidates: dict) -> dict:
    """Each candidate's chance of being accepted: the product of q along its path (a path missing a parent drops)."""
    scores: dict[tuple[int, ...], float] = {}
    for path in sorted(candidates, key=len):
        parent = scores.get(path[:-1], 1.0 if len(path) == 1 else None)
        if parent is not None:
            scores[path] = parent * candidates[path].q
    return scores


def lookup_certainty(scores: dict) -> int:
    """A bucket of the best lookup node's chance of acceptance: 0 (nothing matched or below 5%) .. 3 (over 50%)."""
    return bisect_right(CERTAINTY_EDGES, max(scores.values(), default=0.0))


def best_rate(scores: dict, cost: CostModel, draft_ms: float, limit: int | None = None) -> tuple[int, float]:
    """(n, expected tokens per ms) of the best n-node cut: the n highest scores, n maximising the rate."""
    ordered = sorted(scores.values(), reverse=True)[:limit]
    best_n, best = 0, 1.0 / (cost.verify(1) + draft_ms + OVERHEAD_MS)
    expected = 1.0
    for n, score in enumerate(ordered, 1):
        expected += score
        rate = expected / (cost.verify(n + 1) + draft_ms + OVERHEAD_MS)
        if rate > best:
            best_n, best = n, rate
    return best_n, best


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def cost_model_for(state: SessionState, target) -> CostModel:
    """The session's cost model when it fits this target, else the machine's (`cost_cache.machine_cost_model`: the
    one the target's kernels are set for, the cached one, or a quick first estimate), kept for the session."""
    if state.cost_model is None or not state.cost_model.fits(target):
        state.cost_model = machine_cost_model(target)
    return state.cost_model


def use_cost_model(drafter, cost: CostModel) -> None:
    """Let a drafter that sizes its trees by a cost model (a lookup or combined drafter: its session `state`) use
    `cost` from its next generation on; other drafters consult none."""
    state = getattr(drafter, "state", None)
    if isinstance(state, SessionState):
        state.cost_model = cost


def session_cost_model(drafter) -> CostModel | None:
    """The cost model a lookup or combined drafter's session sizes its trees by (None: none yet, or another kind)."""
    state = getattr(drafter, "state", None)
    return state.cost_model if isinstance(state, SessionState) else None
