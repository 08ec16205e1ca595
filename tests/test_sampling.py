"""Sampling verification (temperature > 0): tokens follow exactly the target's distribution."""

import math

import pytest
import torch

from medusa_like.decoding.draft_tree import DraftTree, grow_dynamic
from medusa_like.decoding.generate import accept_greedy, speculative_generate
from medusa_like.decoding.sampling import PositionNoise, race, warp_logits
from medusa_like.decoding.tree import DynamicTreeSpec, TokenTree, resolve_tree
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.model import MedusaLikeModel

from .conftest import VOCAB, ScriptedProposer, greedy_reference, random_heads, random_prompts, tiny_target


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


def test_sampling_end_to_end_follows_the_target():
    """The second token, the first one verified by a tree, has the target's exact two-step marginal distribution,
    although the candidates are the target's most likely tokens and get accepted often."""
    target = tiny_target("llama")
    tree = resolve_tree("small", 4)
    prompt = random_prompts(1, seed=4, min_len=6, max_len=6)[0]
    temperature = 0.05  # the tiny random model's logits are flat: this spreads the two-step marginal over ~8 tokens
    p1, p2_given_1 = two_step_distributions(target, prompt, temperature)
    exact = p1 @ p2_given_1  # [V]
    # accepting the best candidate whenever it is proposed would give this instead: the test must tell them apart
    always_top1 = p1 @ torch.nn.functional.one_hot(p2_given_1.argmax(-1), VOCAB).float()
    assert 0.5 * (always_top1 - exact).abs().sum() > 0.4

    def likely_candidates(generated):
        proposals = torch.randint(0, VOCAB, (4, tree.top_k))
        proposals[0] = p2_given_1[generated[-1]].topk(tree.top_k).indices
        return proposals

    n = 500
    counts = torch.zeros_like(exact)
    for seed in range(n):
        out = speculative_generate(
            target,
            ScriptedProposer(likely_candidates),
            prompt,
            tree,
            max_new_tokens=2,
            temperature=temperature,
            generator=torch.Generator().manual_seed(seed),
        )
        counts[out.new_tokens[1]] += 1
    total_variation = 0.5 * (counts / n - exact).abs().sum().item()
    assert total_variation < 0.2, total_variation


class LikelyDynamicProposer:
    """Grows EAGLE-2 dynamic trees whose root children are the target's `top_k` likeliest next tokens (scored by the
    target's own probabilities) and whose deeper nodes are random: the tree's shape changes from step to step."""

    feature_layers = None
    max_depth = None
    max_rank = None

    def __init__(self, next_probs: torch.Tensor, seed: int):
        self.next_probs, self.generator = next_probs, torch.Generator().manual_seed(seed)  # [V, V]

    def begin(self, prompt_ids, features, root, capacity):
        self.root = root

    def accept(self, tokens, features, bonus):
        self.root = bonus

    def propose(self, spec):
        return grow_dynamic(spec, self.root, self._expand)

    def _expand(self, frontier, tokens, parents, depth):
        probs = torch.rand(frontier.numel(), VOCAB, generator=self.generator).softmax(-1)  # [F, V]
        if depth == 1:  # the root's children
            probs[0] = self.next_probs[int(tokens[0])]
        top = probs.topk(3, dim=-1)
        return top.indices, top.values.log()


def test_sampling_on_dynamic_trees_follows_the_target():
    """As above, with dynamic trees (EAGLE-2's top-k expansion and best-N selection) instead of a static one."""
    target = tiny_target("qwen2")
    spec = DynamicTreeSpec(depth=3, top_k=3, num_nodes=5)
    prompt = random_prompts(1, seed=6, min_len=5, max_len=5)[0]
    temperature = 0.05
    p1, p2_given_1 = two_step_distributions(target, prompt, temperature)
    exact = p1 @ p2_given_1  # [V]
    always_top1 = p1 @ torch.nn.functional.one_hot(p2_given_1.argmax(-1), VOCAB).float()
    assert 0.5 * (always_top1 - exact).abs().sum() > 0.3

    n, accepted = 500, 0
    counts = torch.zeros_like(exact)
    for seed in range(n):
        proposer = LikelyDynamicProposer(p2_given_1, seed)
        generator = torch.Generator().manual_seed(seed)
        out = speculative_generate(target, proposer, prompt, spec, 2, temperature=temperature, generator=generator)
        counts[out.new_tokens[1]] += 1
        accepted += out.stats.accepted_draft[0]
    assert accepted > n // 4  # the trees' candidates were often accepted: the acceptance rule was exercised
    total_variation = 0.5 * (counts / n - exact).abs().sum().item()
    assert total_variation < 0.2, total_variation


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


@pytest.mark.parametrize(
    ("kind", "tree", "temperature", "top_k", "top_p", "n"),
    [
        ("medusa", "small", 0.05, 4, 1.0, 400),
        ("eagle3", "dynamic", 0.03, 0, 0.8, 600),
        ("eagle3", "small", 0.05, 5, 0.9, 400),
    ],
)
def test_both_drafters_sample_the_targets_two_token_distribution(kind, tree, temperature, top_k, top_p, n):
    """On a sliding-window target (Mistral, prompt longer than the window), the first two tokens drawn by speculative
    sampling with each drafter, through `MedusaLikeModel.generate`, follow the target's exact joint distribution
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
    model = MedusaLikeModel(target, None, drafter, backend="sdpa")
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
