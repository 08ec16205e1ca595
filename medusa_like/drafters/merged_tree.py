"""One tree from several sources: a learned drafter (EAGLE-3 or Medusa heads) and lookup (context, output store),
merged by prefix, each node scored by its calibrated chance of acceptance, cut to a cost-aware budget. The proposer of
the combined drafter, and of lookup alone (no learned drafter).

One step (`MergedTreeProposer.propose`):

    lookup      each source's trie of continuations after the text so far                   (no model: cheap)
    learned     the learned drafter's tree, unless steps without it, where lookup's best guess was as sure as now,
                gave more tokens per ms, measured end to end                     (EAGLE-3: one drafter pass per depth)
    merge       one trie keyed by token paths: two sources proposing the same prefix give one node
    score       q(node) = P(node accepted | parent accepted), calibrated online (`calibration.py`);
                score(node) = product of q along its path: the chance the target accepts it
    budget      the best n nodes by score, n maximising expected tokens per ms under the machine's cost model
                (`budget.py`)

The target verifies the chosen nodes like any tree, and the output stays exactly the target's.
"""

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch

from medusa_like.decoding.cost_model import CostModel
from medusa_like.decoding.draft_tree import DraftTree
from medusa_like.decoding.tree import TreeSpec, budgeted

from .budget import best_rate, lookup_certainty, path_scores
from .calibration import LEARNED, Calibration, learned_key, lookup_key, lookup_prior

PROBE_EVERY = 8  # every this many steps the learned drafter's gate takes the side it judged slower, to keep it measured
STEP_WEIGHT = 0.05  # the weight of one step in the gate's moving averages of tokens and milliseconds per step


@dataclass
class SessionState:
    """What a combined or lookup drafter keeps across generations: calibration, the machine's cost model (set by the
    framework), and the learned drafter's measured time and gain."""

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

    def fork(self) -> "SessionState":
        """A copy of what was learned (calibration, the gate's averages), sharing the machine's cost model."""
        own = copy.deepcopy(dataclasses.replace(self, cost_model=None))
        own.cost_model = self.cost_model
        return own

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


class MergedTreeProposer:
    """The `Proposer` (drafters/protocol.py) of a combined or lookup drafter: `learned` (a drafter, or None) and
    lookup `sources` (objects with `name`, `begin(history)`, `extend(tokens)`, `candidates(history, depth)`);
    `state` is what outlives one generation, its cost model included (set by the framework before a generation:
    `Drafter.use_cost_model`)."""

    def __init__(self, target, learned, sources: list, state: SessionState):
        self.learned = learned.proposer(target) if learned is not None else None
        self.sources = sources
        self.source_names = tuple(s.name for s in self.sources) + ((LEARNED,) if self.learned else ())
        self.feature_layers = self.learned.feature_layers if self.learned else None
        self.max_depth = self.learned.max_depth if self.learned else None
        self.max_rank = self.learned.max_rank if self.learned else None
        self.state = state
        self.calibration = state.calibration
        self.cost: CostModel | None = None  # the state's, read when a sequence begins

    # ---- the protocol ----

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor, root: torch.Tensor, capacity: int) -> None:
        if self.state.cost_model is None:
            raise ValueError(
                "a lookup or combined drafter sizes its trees by this machine's cost model, and none is set: "
                "MedusaLikeModel.generate sets one; with speculative_generate, call drafter.use_cost_model(cost) first"
            )
        self.cost = self.state.cost_model
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
        ran_learned = (
            self.learned is not None
            and spec.learned is not None
            and (spec.shared is None or self._a_node_can_pay(spec, lookup_ms))
            and self._learned_pays(certainty)
        )
        if ran_learned:
            start = time.perf_counter()
            tree = self.learned.propose(spec.learned)
            self.state.learned_ms = _ema(self.state.learned_ms, 1000 * (time.perf_counter() - start))
            self._add_learned(candidates, tree)
            self._calibrate(candidates)
        scores = path_scores(candidates)
        draft_ms = lookup_ms + (self.state.learned_ms if ran_learned else 0.0)
        count, _ = best_rate(scores, self.cost, draft_ms, spec.num_nodes, spec.shared)
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

    def _a_node_can_pay(self, spec: TreeSpec, lookup_ms: float) -> bool:
        """Whether, in a batch (`spec.shared`), running the learned drafter for one node sure to be accepted would
        raise the batch's expected tokens per ms over not running it: the drafter's time counts on its side only, the
        batch's forward priced as the step computes it. Where it would not, no draft of the learned drafter can, and
        it is not run: at 8 rows and more on a CPU the batch's rate is high, and a row's drafting stalls every row
        (docs/results.md, "Batched decoding"). Alone, a sure node always pays, and nothing is asked."""
        learned_ms = self.state.learned_ms or 0.0
        _, without = best_rate({}, self.cost, lookup_ms, spec.num_nodes, spec.shared)
        _, with_it = best_rate({(0,): 1.0}, self.cost, lookup_ms + learned_ms, spec.num_nodes, spec.shared)
        return with_it > without

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


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new
