"""Sampling tests of known power: `warp_logits` against transformers' own logits processors, the race against each
token's probability, and every drafter kind on two families (one sliding its window), whose seeded draws of six
tokens must be plain decoding's, seed by seed.

Why seed by seed is a test of the distribution, and of what power. Plain decoding (`tree="none"`) draws each position's
token by the race over that position's own noise (decoding/sampling.py): it follows the target's warped distribution
exactly when the race does and the warp is transformers' (the first two tests). A drafter and a tree decide only how
many of those tokens a step commits, never which, so speculative sampling must give plain decoding's tokens for every
seed. Any rule whose draws are off by a total variation of at least TV_BIAS from the target's joint distribution
differs from plain decoding's draw of the same seed with probability at least TV_BIAS (two draws of distributions
TV_BIAS apart, however coupled, differ that often), so SEEDS seeds all equal happen with probability below
(1 - TV_BIAS) ** SEEDS < FALSE_PASS; an exact rule never differs. Each run shows it on a rule biased by TV_BIAS
(`CarelessAcceptance`, which accepts a first draft untested now and then): some seed differs.
"""

import math

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from medusa_like.decoding import generate
from medusa_like.decoding.sampling import NUCLEUS_CANDIDATES, race, warp_logits
from medusa_like.drafters.protocol import sized_by_cost_model
from medusa_like.drafters.registry import all_kinds, kind_named
from medusa_like.model import MedusaLikeModel

from .conftest import flat_cost, tiny_target
from .test_sampling import CarelessAcceptance, joint_distribution, samples_to_catch

TV_BIAS = 0.05  # the total-variation bias a test must catch
FALSE_PASS = 1e-3  # the chance that a rule biased by TV_BIAS passes
SEEDS = math.ceil(math.log(FALSE_PASS) / math.log(1 - TV_BIAS))  # 135: (1 - TV_BIAS) ** SEEDS < FALSE_PASS
NEW_TOKENS = 6  # long enough that accepted drafts of depth 2 and more decide emitted tokens
SMALL_VOCAB = 8  # drafts of a few candidates are often right: accepted at every depth
WARP = {"temperature": 0.9, "top_k": 3, "top_p": 0.9}
PROMPT = torch.tensor([[3, 1, 2, 3, 1, 2, 5, 3, 1, 2]])  # repeats (lookup drafts from it), longer than the window


# ---------------------------------------------------------------------------------------------------------------------
# The warp and the race, against independent references


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "vocab"),
    [
        (0.7, 0, 1.0, 50), (1.3, 5, 1.0, 50), (1.0, 0, 0.8, 50), (0.5, 10, 0.9, 50), (1.0, 1, 1.0, 50),
        (2.0, 40, 0.3, 50), (0.9, 3, 0.95, 50),
        (0.3, 0, 0.9, 1000),  # peaked: the nucleus among the likeliest NUCLEUS_CANDIDATES
        (3.0, 0, 0.9, 1000),  # flat: a nucleus wider than them, found by the full sort
    ],
)  # fmt: skip
def test_warp_logits_equals_transformers_logits_processors(temperature, top_k, top_p, vocab):
    """On random logits, the probabilities `warp_logits` gives equal the softmax of what transformers' own warpers
    leave, applied in the order its `generate` applies them (temperature, top-k, top-p): the same tokens kept, the
    same probabilities; a nucleus within the likeliest candidates and one wider than them alike."""
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(top_k)) * 3  # [B, V]
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    theirs = LogitsProcessorList(warpers)(torch.zeros(64, 1, dtype=torch.long), logits.clone()).softmax(-1)
    ours = warp_logits(logits, temperature, top_k, top_p)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs)
    kept = (ours > 0).sum(-1)
    assert (kept <= (top_k or vocab)).all() and (kept < vocab).any() == (top_k > 0 or top_p < 1)  # the filters cut
    if vocab > NUCLEUS_CANDIDATES:  # each of the nucleus's two searches ran
        assert (kept > NUCLEUS_CANDIDATES).any() == (temperature > 1)


def test_the_race_draws_each_token_with_its_probability_and_the_statistic_catches_a_biased_one():
    """The race (argmax p / E, E ~ Exp(1) per token) over many noise rows at once: the empirical distribution stays
    within `samples_to_catch`'s threshold of p, and a race over a distribution TV_BIAS / 2 away from p (the same noise)
    exceeds it: both errors below FALSE_PASS."""
    generator = torch.Generator().manual_seed(0)
    probs = warp_logits(torch.randn(SMALL_VOCAB, generator=generator) * 2, 1.0)  # [V]
    bias = TV_BIAS / 2
    n, threshold = samples_to_catch(SMALL_VOCAB, bias, FALSE_PASS)
    noise = torch.empty(n, SMALL_VOCAB).exponential_(generator=generator)  # [n, V]

    def total_variation(p):
        counts = torch.bincount(race(p.expand(n, -1), noise), minlength=SMALL_VOCAB)
        return 0.5 * (counts / n - probs).abs().sum().item()

    rare = int(probs.argmin())
    shifted = probs * (1 - 2 * bias) + 2 * bias * torch.nn.functional.one_hot(torch.tensor(rare), SMALL_VOCAB)
    assert 0.5 * (shifted - probs).abs().sum().item() >= bias
    assert total_variation(probs) < threshold < total_variation(shifted)


# ---------------------------------------------------------------------------------------------------------------------
# Every drafter kind: seeded draws through trees are plain decoding's, seed by seed


def fresh_drafter(kind: str, target):
    """A new drafter of `kind` for `target`, as `MedusaLikeModel.from_pretrained(target, drafter=kind)` makes one; a
    kind that merges a learned drafter with its own sources (combined) gets an EAGLE-3 drafter started from the
    target's last layer and head (often right). A new kind needs nothing here."""
    kind = kind_named(kind)
    if not kind.takes_learned:
        return kind.fresh(target)
    learned = kind_named("eagle3").fresh(target)
    learned.init_layer_from_target(target, target.config.num_hidden_layers - 1)
    learned.init_from_target(target)
    return kind.fresh(target, learned=learned)


def sampling_model(kind: str, family: str, drafter_dtype=None) -> MedusaLikeModel:
    """A small-vocabulary target of `family` with a new `kind` drafter; a drafter that sizes trees by a cost model gets
    one where verifying costs the same at any size (every candidate kept), and one that learns from outputs has seen
    twenty of the target's samples (lookup drafts from the start)."""
    target = tiny_target(family, vocab_size=SMALL_VOCAB)
    model = MedusaLikeModel(target, None, fresh_drafter(kind, target), drafter_dtype=drafter_dtype)
    if sized_by_cost_model(model.drafter):
        model.drafter.use_cost_model(flat_cost(model.target))
    for seed in range(20):
        model.generate(PROMPT, NEW_TOKENS, tree="none", seed=10_000 + seed, eos_token_id=[], **WARP)
    return model


def careless_bias(model) -> float:
    """The probability `CarelessAcceptance` needs to bias the joint distribution of the first two tokens (so of all
    six) by at least TV_BIAS: the second token becomes the first draft with that probability, which moves the joint by
    at least eps * E_t1[1 - max_t p(t | t1)]."""
    joint = joint_distribution(model.target, PROMPT, 2, **WARP).view(SMALL_VOCAB, SMALL_VOCAB)  # p(t1, t2)
    first = joint.sum(1)
    conditional = joint / first.clamp_min(1e-30)[:, None]  # p(t2 | t1)
    spread = float((first * (1 - conditional.max(1).values)).sum())
    assert spread > TV_BIAS, spread  # a bias of TV_BIAS is reachable with eps <= 1
    return TV_BIAS / spread


def assert_seed_by_seed_equal_and_a_biased_rule_caught(model, tree, monkeypatch) -> None:
    """SEEDS seeded draws through `tree` equal plain decoding's, with drafts of depth 2 or more accepted; then the
    same draws under `CarelessAcceptance` biased by TV_BIAS: some seed differs (the statistic has the power it
    claims on this very setup)."""

    def draws(seed: int, tree):
        return model.generate(PROMPT, NEW_TOKENS, tree=tree, seed=seed, eos_token_id=[], remember=False, **WARP)

    plain = [draws(seed, "none").new_tokens.tolist() for seed in range(SEEDS)]
    deep = 0
    for seed in range(SEEDS):
        out = draws(seed, tree)
        assert out.new_tokens.tolist() == plain[seed], f"seed {seed}"
        deep += sum(accepted >= 2 for accepted in out.stats.accepted_draft)
    assert deep > 0, "no draft of depth 2 was accepted: drafted nodes never decided an emitted token"

    careless = CarelessAcceptance(careless_bias(model))
    monkeypatch.setattr(generate, "accept_greedy", careless)  # the loop calls the rule through its own module
    differing = []
    for seed in range(SEEDS):
        careless.first_step = True
        if draws(seed, tree).new_tokens.tolist() != plain[seed]:
            differing.append(seed)
            break  # caught: the rest cannot uncatch it
    assert careless.childless == 0  # every first step had a draft to accept untested: the bias is at least TV_BIAS
    assert differing, f"a rule biased by {TV_BIAS} in TV passed {SEEDS} seeds"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: every layer slides a window shorter than the draws
@pytest.mark.parametrize("kind", sorted(all_kinds()))
def test_every_drafter_kind_samples_plain_decodings_tokens_seed_by_seed(kind, family, monkeypatch):
    """Every registered drafter kind, on its new drafter's own trees (`tree="dynamic"`)."""
    assert_seed_by_seed_equal_and_a_biased_rule_caught(sampling_model(kind, family), "dynamic", monkeypatch)


@pytest.mark.slow
def test_an_eagle3_drafter_drafting_in_bf16_beside_an_fp32_target_samples_plain_decodings_tokens(monkeypatch):
    model = sampling_model("eagle3", "mistral", drafter_dtype="bfloat16")
    assert model.drafter_dtype == torch.bfloat16 and model.target.dtype == torch.float32
    assert_seed_by_seed_equal_and_a_biased_rule_caught(model, "small", monkeypatch)
