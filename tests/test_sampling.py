"""Sampling verification (temperature > 0): tokens follow exactly the target's distribution."""

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
from medusa_like.drafters.eagle3 import EAGLE3, Eagle3Config, Eagle3Drafter
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.drafters.lookup_sources import OutputStore
from medusa_like.model import MedusaLikeModel

from .conftest import VOCAB, greedy_reference, random_heads, random_prompts, tiny_target
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


def two_step_distributions(
    target, prompt, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's warped distribution of the first new token [V] and of the second given the first [V, V]."""
    with torch.no_grad():
        p1 = warp_logits(target(prompt).logits[0, -1], temperature, top_k, top_p)  # [V]
        extended = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
        p2_given_1 = warp_logits(target(extended).logits[:, -1], temperature, top_k, top_p)  # [V, V]
    return p1, p2_given_1


def test_sampling_is_reproducible_and_near_zero_temperature_is_greedy():
    target = tiny_target("qwen2")
    model = MedusaLikeModel(target, None, random_heads(), backend="sdpa")
    prompt = random_prompts(1, seed=2)[0]
    a = model.generate(prompt, max_new_tokens=20, tree="small", temperature=1.0, seed=7, eos_token_id=[])
    b = model.generate(prompt, max_new_tokens=20, tree="small", temperature=1.0, seed=7, eos_token_id=[])
    assert a.new_tokens.tolist() == b.new_tokens.tolist()
    cold = model.generate(prompt, max_new_tokens=20, tree="small", temperature=1e-6, seed=7, eos_token_id=[])
    assert cold.new_tokens.tolist() == greedy_reference(target, prompt, 20).tolist()
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0, got -1.0"):
        model.generate(prompt, max_new_tokens=4, temperature=-1.0)


def tv_bound(exact: torch.Tensor, n: int, false_failure: float) -> float:
    """A total-variation distance that n samples of `exact` exceed with probability below `false_failure`:
    E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen), and TV moves by at most 1/n per sample, so by McDiarmid's
    inequality P(TV > E[TV] + eps) <= exp(-2 n eps^2)."""
    mean = 0.5 * (exact * (1 - exact) / n).sqrt().sum().item()
    return mean + math.sqrt(math.log(1 / false_failure) / (2 * n))


def eagle3_from_target(target) -> Eagle3Drafter:
    """An EAGLE-3 drafter started as training starts it (the target's projection and final norm) with its feature
    taken from the target's highest aux layer: its guesses follow the target's own, so drafts often get accepted."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, VOCAB))
    size = target.config.hidden_size
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(std=0.02)
        layer = drafter.config.aux_layer_ids.index(max(drafter.config.aux_layer_ids))
        drafter.fc.weight[:, layer * size : (layer + 1) * size] += torch.eye(size)
        drafter.init_from_target(target)
    return drafter


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "tree", "temperature", "top_k", "top_p", "n", "drafter_dtype"),
    [
        ("medusa", "small", 0.05, 4, 1.0, 400, None),
        ("eagle3", "dynamic", 0.03, 0, 0.8, 600, None),
        ("eagle3", "small", 0.05, 5, 0.9, 400, "bfloat16"),  # drafting in bf16, the target in fp32
    ],
)
def test_both_drafters_sample_the_targets_two_token_distribution(
    kind, tree, temperature, top_k, top_p, n, drafter_dtype
):
    """On a sliding-window target (Mistral, prompt longer than the window), the first two tokens drawn by speculative
    sampling with each drafter (EAGLE-3 drafting in fp32 and in bf16), through `MedusaLikeModel.generate`, follow the target's exact joint distribution
    p(t1) p(t2 | t1) under temperature, top-k and top-p: the empirical TV distance stays below a bound derived from
    the sample size (false failure probability 1e-3), which the always-accept-the-top-candidate distribution exceeds."""
    target = tiny_target("mistral")
    prompt = random_prompts(1, seed=12, min_len=10, max_len=10)[0]
    p1, p2_given_1 = two_step_distributions(target, prompt, temperature, top_k, top_p)
    exact = (p1[:, None] * p2_given_1).flatten()  # [V * V]: the joint of (t1, t2)
    bound = tv_bound(exact, n, 1e-3)
    wrong = (p1[:, None] * torch.nn.functional.one_hot(p2_given_1.argmax(-1), VOCAB)).flatten()
    assert 0.5 * (wrong - exact).abs().sum() > 2 * bound  # the test can tell a biased sampler apart

    drafter = random_heads(std=0.0) if kind == "medusa" else eagle3_from_target(target)
    model = MedusaLikeModel(target, None, drafter, backend="sdpa", drafter_dtype=drafter_dtype)
    counts, accepted = torch.zeros_like(exact), 0
    for seed in range(n):
        out = model.generate(
            prompt, 2, tree=tree, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=[]
        )
        first, second = out.new_tokens.tolist()
        counts[first * VOCAB + second] += 1
        accepted += out.stats.accepted_draft[0]
    assert accepted >= 10, accepted  # drafts were accepted (12 to 50 times here): the acceptance rule was sampled
    total_variation = 0.5 * (counts / n - exact).abs().sum().item()
    assert total_variation < bound, (total_variation, bound)


# ---------------------------------------------------------------------------------------------------------------------
# Through a combined drafter (a random-weight EAGLE-3 drafter and lookup in one tree): three tokens jointly, with a
# sample size that catches a small bias, and the same statistic shown to catch a biased acceptance rule

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

    def sample(self, n: int, before_each: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, DecodeStats]:
        """The empirical joint distribution of n generations' three tokens (seeds 0..n-1), and their summed stats;
        `before_each` is called before each generation."""
        vocab, counts, total = self.target.config.vocab_size, torch.zeros_like(self.exact), DecodeStats()
        for seed in range(n):
            before_each()
            # a fresh session each time (calibration, gate and cost model): every sample is drafted alike
            drafter = CombinedDrafter(self.learned, LookupDrafter(self.store), self.cost)
            generator = torch.Generator().manual_seed(seed)
            out = speculative_generate(
                self.target, drafter.proposer(self.target), self.prompt, self.spec, 3, generator=generator,
                **COMBINED_WARP,
            )  # fmt: skip
            first, second, third = out.new_tokens.tolist()
            counts[(first * vocab + second) * vocab + third] += 1
            total.accepted_draft += out.stats.accepted_draft[:1]  # the first step's: the one every sample has
            for name, count in out.stats.accepted_by_source.items():
                total.accepted_by_source[name] = total.accepted_by_source.get(name, 0) + count
        return counts / n, total


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


@pytest.mark.slow
def test_sampling_through_a_combined_drafter_follows_the_targets_joint_distribution(combined_sampling):
    """Three tokens drawn through combined trees (the EAGLE-3 drafter's dynamic tree merged with context lookup and
    the output store, drafts accepted at depths 1 and 2 from every source) follow the target's exact joint
    distribution: the empirical TV distance stays under a threshold that a sampler biased by TV_BIAS would exceed
    (`samples_to_catch`: both errors below FALSE_FAILURE)."""
    exact = combined_sampling.exact
    support = int((exact > 0).sum())
    assert support == 8  # two tokens possible at each of three positions
    n, threshold = samples_to_catch(support, TV_BIAS, FALSE_FAILURE)
    empirical, stats = combined_sampling.sample(n)
    accepted = stats.accepted_by_source
    assert min(accepted.get(name, 0) for name in ("learned", "context", "store")) > n // 50, accepted
    assert stats.accepted_draft.count(2) > n // 10  # a whole depth-2 path accepted in one step
    total_variation = 0.5 * (empirical - exact).abs().sum().item()
    assert total_variation < threshold, (total_variation, threshold, n)


class CarelessAcceptance:
    """A biased acceptance rule: at a generation's first verification, with probability `eps` (its own coin), the
    root's first child is accepted untested; otherwise `accept_greedy` decides. Every token other than the second
    keeps its exact distribution, and the second is the first child c1 with probability eps + (1 - eps) p(c1 | t1):
    the joint is off by eps * E_t1[1 - p(c1 | t1)] >= eps * E_t1[1 - max_t p(t | t1)] in TV."""

    def __init__(self, eps: float):
        self.eps, self.coin = eps, torch.Generator().manual_seed(1)
        self.first_step, self.untested, self.childless = False, 0, 0

    def __call__(self, tokens, predictions, tree):
        first_step, self.first_step = self.first_step, False
        if first_step and not tree.children[0]:
            self.childless += 1
        elif first_step and torch.rand((), generator=self.coin) < self.eps:
            self.untested += 1
            return torch.tensor([0, tree.children[0][0]], device=tokens.device)
        return accept_greedy(tokens, predictions, tree)


@pytest.mark.heavy  # the power of the statistic above, not of the code: 80 s of a core, in make test-all
def test_the_joint_distribution_statistic_catches_a_slightly_biased_acceptance_rule(combined_sampling, monkeypatch):
    """The power of the statistic above: the same sampling, sample size and threshold, with the acceptance rule
    replaced by one whose output is off by at least TV_BIAS, fail it."""
    exact = combined_sampling.exact
    n, threshold = samples_to_catch(int((exact > 0).sum()), TV_BIAS, FALSE_FAILURE)
    joint = exact.view(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB)
    p_first, p_second = joint.sum((1, 2)), joint.sum(2)  # [V], [V, V]: p(t1), p(t1, t2)
    conditional = p_second / p_first.clamp_min(1e-30)[:, None]  # p(t2 | t1)
    eps = TV_BIAS / float((p_first * (1 - conditional.max(1).values)).sum())  # the bias is at least TV_BIAS
    careless = CarelessAcceptance(eps)
    monkeypatch.setattr(generate, "accept_greedy", careless)  # the loop calls the rule through its own module

    def next_generation():
        careless.first_step = True

    empirical, _ = combined_sampling.sample(n, before_each=next_generation)
    assert careless.childless == 0  # every first step had a candidate to accept untested: the bias is as above
    assert careless.untested > 0
    total_variation = 0.5 * (empirical - exact).abs().sum().item()
    assert total_variation > threshold, (total_variation, threshold, n)
    assert total_variation < 4 * TV_BIAS  # a small bias, not a gross one, was caught
