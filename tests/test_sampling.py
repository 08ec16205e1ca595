"""Sampling verification (temperature > 0): tokens follow exactly the target's distribution: the acceptance rule on a
hand-made tree, and three tokens through a combined drafter against the target's exact joint distribution, with the
statistic's power shown on a biased rule in the same run (every kind, six tokens: tests/test_sampling_power.py)."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from medusa_like.decoding import generate
from medusa_like.decoding.cost_model import CostModel
from medusa_like.decoding.draft_tree import DraftTree
from medusa_like.decoding.generate import DecodeStats, accept_greedy, speculative_generate
from medusa_like.decoding.sampling import PositionNoise, race, warp_logits
from medusa_like.decoding.tree import BudgetedTreeSpec, DynamicTreeSpec, TokenTree
from medusa_like.drafters.combined import CombinedDrafter
from medusa_like.drafters.eagle3 import EAGLE3, Eagle3Drafter
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.drafters.lookup_sources import OutputStore
from medusa_like.model import MedusaLikeModel

from .conftest import random_heads, random_prompts, stock_greedy, tiny_target, untouched_target
from .test_lookup import flat_cost


@pytest.mark.slow
def test_acceptance_rule_emits_the_target_distribution():
    """Verification by the race with per-position noise: the first emitted token ~ p(root) and, after a first token t,
    the next one ~ p(t), whatever the candidates; the drafts change only how many tokens are accepted."""
    tree = TokenTree.from_paths([[0], [1], [2], [0, 0]])  # nodes: 0 root, 1 [0], 2 [1], 3 [2], 4 [0,0]
    after_1 = [0.1, 0.1, 0.6, 0.1, 0.1]
    probs = torch.tensor(
        [
            [0.5, 0.2, 0.2, 0.1, 0.0],  # root
            after_1,  # after node 1 (token 1)
            [0.2, 0.2, 0.2, 0.2, 0.2],
            after_1,  # node 3 repeats node 1's token, so the target's distribution after it is the same
            [0.3, 0.3, 0.1, 0.1, 0.2],
        ]
    )
    tokens = torch.tensor([9, 1, 0, 1, 2])
    draft = DraftTree.from_static(tree, tokens)  # the step's tree, as verification receives it
    g = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(5)
    second_after_1 = torch.zeros(5)
    accepted = 0
    for _ in range(n):
        noise = PositionNoise(5, "cpu", g).take(0, draft.max_depth + 1)  # [D + 1, V]: one row per position
        predictions = race(probs, noise[draft.depth])  # [T]
        nodes = accept_greedy(tokens, predictions, draft)
        emitted = [int(tokens[i]) for i in nodes[1:]] + [int(predictions[nodes[-1]])]
        accepted += len(nodes) - 1
        first[emitted[0]] += 1
        if emitted[0] == 1:
            second_after_1[emitted[1]] += 1
    tolerance = 4 * (0.25 / n) ** 0.5
    torch.testing.assert_close(first / n, probs[0], atol=tolerance, rtol=0)
    m = second_after_1.sum()
    torch.testing.assert_close(second_after_1 / m, probs[1], atol=4 * (0.25 / m) ** 0.5, rtol=0)
    # a node's children are accepted with the sum of p over their tokens (as under SpecInfer's multi-candidate rule):
    # tokens 0 or 1 first (.5 + .2), then after token 1, node 4's token 2 (.6)
    assert abs(accepted / n - (0.7 + 0.2 * after_1[2])) < 0.03


def test_warp_logits():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    torch.testing.assert_close(warp_logits(logits, 1.0), logits.softmax(-1))
    top2 = warp_logits(logits, 1.0, top_k=2)
    assert (top2[2:] == 0).all() and top2.sum().item() == pytest.approx(1.0)
    nucleus = warp_logits(logits, 1.0, top_p=0.7)  # p = .64, .24, .09, .03: the first two reach .7
    assert (nucleus > 0).tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="temperature > 0"):
        warp_logits(logits, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        warp_logits(logits, 1.0, top_p=0.0)


def test_sampling_is_reproducible_and_near_zero_temperature_is_greedy():
    target = tiny_target("qwen2")
    model = MedusaLikeModel(target, None, random_heads(), backend="sdpa")
    prompt = random_prompts(1, seed=2)[0]
    a = model.generate(prompt, max_new_tokens=20, tree="small", temperature=1.0, seed=7, eos_token_id=[])
    b = model.generate(prompt, max_new_tokens=20, tree="small", temperature=1.0, seed=7, eos_token_id=[])
    assert a.new_tokens.tolist() == b.new_tokens.tolist()
    cold = model.generate(prompt, max_new_tokens=20, tree="small", temperature=1e-6, seed=7, eos_token_id=[])
    assert cold.new_tokens.tolist() == stock_greedy(untouched_target("qwen2"), [prompt], 20)[0]
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got -1.0"):
        model.generate(prompt, max_new_tokens=4, temperature=-1.0)


# ---------------------------------------------------------------------------------------------------------------------
# Through a combined drafter (a random-weight EAGLE-3 drafter and lookup in one tree): three tokens jointly against the
# target's exact joint distribution, with a sample size that catches a small bias, and the same statistic shown to
# catch a biased acceptance rule in the same run. (Every kind on two families, six tokens, seed by seed against plain
# decoding: tests/test_sampling_power.py.)

SMALL_VOCAB = 8
COMBINED_WARP = {"temperature": 1.0, "top_k": 2}  # two tokens possible at each position: 8 cells for three tokens
TV_BIAS = 0.05  # the total-variation bias of the joint distribution the statistic must catch
FALSE_FAILURE = 1e-3  # the chance that an exact sampler fails, and that one biased by TV_BIAS passes


def samples_to_catch(support: int, bias: float, false_failure: float) -> tuple[int, float]:
    """(n, threshold): a sample size and a bound on TV(empirical, p), p the exact distribution over `support` cells,
    that an exact sampler exceeds, and a sampler q with TV(q, p) >= `bias` stays under, each with probability below
    `false_failure`.

    Exact: TV(p_n, p) is the largest p_n(A) - p(A) over the 2^support sets A of cells; Hoeffding gives each
    P(p_n(A) - p(A) >= t) <= exp(-2 n t^2), so P(TV >= t) <= 2^support exp(-2 n t^2) = false_failure at
    t = sqrt((support ln 2 + ln(1 / false_failure)) / (2 n)).
    Biased: on the set A* where q exceeds p, q(A*) - p(A*) = TV(q, p) >= bias and TV(q_n, p) >= q_n(A*) - p(A*);
    Hoeffding once, q_n(A*) <= q(A*) - s with probability <= exp(-2 n s^2) = false_failure at
    s = sqrt(ln(1 / false_failure) / (2 n)), so q stays under t with probability below false_failure once
    t + s <= bias: n is the smallest such size."""
    null, alternative = support * math.log(2) + math.log(1 / false_failure), math.log(1 / false_failure)
    n = math.ceil(((math.sqrt(null) + math.sqrt(alternative)) / bias) ** 2 / 2)
    return n, math.sqrt(null / (2 * n))


def joint_distribution(target, prompt, length: int, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The target's warped joint distribution of its next `length` tokens [V ** length] (cell (t1 * V + t2) * V + ...),
    from full forwards over the prompt and every prefix of new tokens."""
    vocab = target.config.vocab_size
    joint, prefixes = torch.ones(1), prompt  # [M], [M, L]: every prefix so far and its probability
    with torch.no_grad():
        for step in range(length):
            probs = warp_logits(target(prefixes).logits[:, -1], temperature, top_k, top_p)  # [M, V]
            joint = (joint[:, None] * probs).flatten()  # [M * V]
            if step + 1 < length:
                last = torch.arange(vocab).repeat(len(prefixes))[:, None]  # [M * V, 1]
                prefixes = torch.cat([prefixes.repeat_interleave(vocab, dim=0), last], dim=1)
    return joint


@dataclass
class CombinedSampling:
    """The setup both tests below sample: a small-vocabulary target, a prompt that repeats (context lookup drafts
    from it), an output store holding the target's likeliest two-token continuations of each likely first token,
    a random-weight EAGLE-3 drafter, and the target's exact joint distribution of three new tokens."""

    target: torch.nn.Module
    prompt: torch.Tensor
    learned: Eagle3Drafter
    store: OutputStore
    cost: CostModel  # verifying any number of nodes costs the same: the budget keeps every candidate
    exact: torch.Tensor  # [V ** 3]
    spec = BudgetedTreeSpec(DynamicTreeSpec(depth=2, top_k=3, num_nodes=6), num_nodes=8, lookup_depth=2)

    def sample(self, seeds, before_each: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, DecodeStats]:
        """The cell of each seed's three tokens [len(seeds)] (cell (t1 * V + t2) * V + t3), and their summed stats;
        `before_each` is called before each generation."""
        vocab, cells, total = self.target.config.vocab_size, [], DecodeStats()
        for seed in seeds:
            before_each()
            # a fresh session each time (calibration, gate and cost model): every sample is drafted alike
            drafter = CombinedDrafter(self.learned, LookupDrafter(self.store), self.cost)
            generator = torch.Generator().manual_seed(seed)
            out = speculative_generate(
                self.target, drafter.proposer(self.target), self.prompt, self.spec, 3, generator=generator,
                **COMBINED_WARP,
            )  # fmt: skip
            first, second, third = out.new_tokens.tolist()
            cells.append((first * vocab + second) * vocab + third)
            total.accepted_draft += out.stats.accepted_draft[:1]  # the first step's: the one every sample has
            for name, count in out.stats.accepted_by_source.items():
                total.accepted_by_source[name] = total.accepted_by_source.get(name, 0) + count
        return torch.tensor(cells, dtype=torch.long), total

    def empirical(self, cells: torch.Tensor) -> torch.Tensor:
        """The empirical joint distribution [V ** 3] of drawn cells."""
        return torch.bincount(cells, minlength=self.exact.numel()) / cells.numel()


@pytest.fixture(scope="module")
def combined_sampling() -> CombinedSampling:
    target = tiny_target("llama", vocab_size=SMALL_VOCAB)
    prompt = torch.tensor([[3, 1, 2, 3, 1, 2]])
    exact = joint_distribution(target, prompt, 3, **COMBINED_WARP)
    joint = exact.view(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB)
    store = OutputStore()
    for first in joint.sum((1, 2)).nonzero().flatten().tolist():
        second = int(joint[first].sum(1).argmax())
        store.add([first, second, int(joint[first, second].argmax())])
    torch.manual_seed(0)
    return CombinedSampling(target, prompt, EAGLE3.fresh(target).eval(), store, flat_cost(target), exact)


class CarelessAcceptance:
    """A biased acceptance rule: at a generation's first verification, with probability `eps`, the root's first child
    is accepted untested; otherwise `accept_greedy` decides. Every token other than the second keeps its exact
    distribution, and the second is the first child c1 with probability eps + (1 - eps) p(c1 | t1): the joint is off
    by eps * E_t1[1 - p(c1 | t1)] >= eps * E_t1[1 - max_t p(t | t1)] in TV. Its coin is `fires(seed)` where a
    generation's seed is set (`seed`), else its own generator's."""

    def __init__(self, eps: float):
        self.eps, self.coin = eps, torch.Generator().manual_seed(1)
        self.first_step, self.untested, self.childless = False, 0, 0
        self.seed: int | None = None

    def fires(self, seed: int) -> bool:
        """Whether the coin of the generation seeded `seed` accepts untested: a function of the seed alone."""
        return bool(torch.rand((), generator=torch.Generator().manual_seed(1_000_003 + seed)) < self.eps)

    def __call__(self, tokens, predictions, tree):
        first_step, self.first_step = self.first_step, False
        if first_step and not tree.children[0]:
            self.childless += 1
        elif first_step and (
            self.fires(self.seed) if self.seed is not None else torch.rand((), generator=self.coin) < self.eps
        ):
            self.untested += 1
            return torch.tensor([0, tree.children[0][0]], device=tokens.device)
        return accept_greedy(tokens, predictions, tree)


@pytest.mark.slow
def test_sampling_through_a_combined_drafter_follows_the_targets_joint_distribution_and_a_biased_rule_fails(
    combined_sampling, monkeypatch
):
    """Three tokens drawn through combined trees (the EAGLE-3 drafter's dynamic tree merged with context lookup and
    the output store, drafts accepted at depths 1 and 2 from every source) follow the target's exact joint
    distribution: the empirical TV distance stays under a threshold that a sampler biased by TV_BIAS exceeds
    (`samples_to_catch`: both errors below FALSE_FAILURE).

    And in the same run, the power: the acceptance rule replaced by `CarelessAcceptance`, whose output is off by at
    least TV_BIAS, fails the same statistic at the same size. Its coin is a function of the seed and it equals
    `accept_greedy` wherever the coin does not fire, so its draw of every other seed is the exact rule's draw above:
    only the seeds whose coin fires are drawn again (about one in eps)."""
    exact = combined_sampling.exact
    support = int((exact > 0).sum())
    assert support == 8  # two tokens possible at each of three positions
    n, threshold = samples_to_catch(support, TV_BIAS, FALSE_FAILURE)
    cells, stats = combined_sampling.sample(range(n))
    accepted = stats.accepted_by_source
    assert min(accepted.get(name, 0) for name in ("learned", "context", "store")) > n // 50, accepted
    assert stats.accepted_draft.count(2) > n // 10  # a whole depth-2 path accepted in one step
    total_variation = 0.5 * (combined_sampling.empirical(cells) - exact).abs().sum().item()
    assert total_variation < threshold, (total_variation, threshold, n)

    joint = exact.view(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB)
    p_first, p_second = joint.sum((1, 2)), joint.sum(2)  # [V], [V, V]: p(t1), p(t1, t2)
    conditional = p_second / p_first.clamp_min(1e-30)[:, None]  # p(t2 | t1)
    eps = TV_BIAS / float((p_first * (1 - conditional.max(1).values)).sum())  # the bias is at least TV_BIAS
    careless = CarelessAcceptance(eps)
    monkeypatch.setattr(generate, "accept_greedy", careless)  # the loop calls the rule through its own module
    fired = [seed for seed in range(n) if careless.fires(seed)]
    order = iter(fired)

    def next_generation():
        careless.first_step, careless.seed = True, next(order)

    biased = cells.clone()
    biased[fired] = combined_sampling.sample(fired, before_each=next_generation)[0]
    assert careless.childless == 0  # every first step had a candidate to accept untested: the bias is as above
    assert careless.untested == len(fired) > 0
    total_variation = 0.5 * (combined_sampling.empirical(biased) - exact).abs().sum().item()
    assert total_variation > threshold, (total_variation, threshold, n)
    assert total_variation < 4 * TV_BIAS  # a small bias, not a gross one, was caught
