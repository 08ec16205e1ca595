"""EAGLE-3 draft tokens do get accepted: an oracle drafter on a target that repeats its last token, and a drafter
trained for a few dozen steps on a tiny low-entropy target; the drafter's own KV cache stays exact across many
accept/rewind steps (its proposals equal a from-scratch recomputation at every step)."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from medusa_like.decoding.generate import speculative_generate
from medusa_like.decoding.tree import DynamicTreeSpec, TokenTree, resolve_tree
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Proposer
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.training.eagle3_module import Eagle3Module

from .conftest import VOCAB, greedy_reference, random_prompts, tiny_target

# ---------------------------------------------------------------------------------------------------------------------
# (a) An oracle: the target repeats its last token, and the drafter is set up to predict exactly that


def repeating_target(family: str):
    """A tiny target whose layers add nothing (zero output projections): its hidden state is the token's embedding,
    so (tied embeddings) its greedy continuation repeats the prompt's last token."""
    target = tiny_target(family, tie_word_embeddings=True)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target


def oracle_drafter(target) -> Eagle3Drafter:
    """A drafter whose state is its input feature (attention and MLP outputs zero, fc the identity on one aux layer,
    projection and final norm the target's, scaled to be confident): for this target it predicts the token it was fed,
    at every depth, with a probability near 1 (so dynamic trees keep that chain)."""
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, VOCAB))
    hidden = target.config.hidden_size
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(std=0.3)  # the attention and MLP still compute (over the cache), their output is dropped
        drafter.self_attn.o_proj.weight.zero_()
        drafter.mlp.down_proj.weight.zero_()
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, :hidden] = torch.eye(hidden)
        for norm in (drafter.hidden_norm, drafter.input_layernorm, drafter.post_attention_layernorm):
            norm.weight.fill_(1.0)
        drafter.init_from_target(target)
        drafter.lm_head.weight.mul_(1000)  # the same argmax, sharper: the tiny target's own logits are nearly flat
    return drafter.eval()


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize(
    "spec", ["chain", "small", DynamicTreeSpec(depth=4, top_k=3, num_nodes=10), DynamicTreeSpec(6, 2, 8)]
)
def test_an_oracle_drafter_gets_its_whole_depth_accepted_every_step(family, spec):
    target = repeating_target(family)
    proposer = Eagle3Proposer(oracle_drafter(target), target)
    tree = resolve_tree(spec, None)
    for prompt in random_prompts(3, seed=7, min_len=3, max_len=12):
        expected = greedy_reference(target, prompt, 40).tolist()
        assert expected == [int(prompt[0, -1])] * 40  # the oracle's premise: the target repeats its last token
        out = speculative_generate(target, proposer, prompt, tree, 40)
        assert out.new_tokens.tolist() == expected
        steps = out.stats.accepted_draft
        assert steps[:-1] == [tree.max_depth] * (len(steps) - 1)  # the last step may be cut by max_new_tokens
        assert len(steps) == -(-(40 - 1) // (tree.max_depth + 1))  # ceil: the prefill yields the first token


# ---------------------------------------------------------------------------------------------------------------------
# (b) A drafter trained for a few dozen steps on a tiny low-entropy target


def sharp_target():
    """A tiny random llama with its logits scaled x20: nearly deterministic, its greedy text falls into loops."""
    target = tiny_target("llama")
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(20)
    return target


def greedy_rows(target, count: int, seed: int, width: int = 48) -> list[dict]:
    """Training rows: random 4-token prompts and the target's greedy continuation (the loss on the continuation)."""
    rows = []
    for index, prompt in enumerate(random_prompts(count, seed=seed, min_len=4, max_len=4)):
        ids = torch.cat([prompt[0], greedy_reference(target, prompt, width - 4)])
        loss_mask = torch.ones(width, dtype=torch.long)
        loss_mask[:4] = 0
        rows.append(
            {"input_ids": ids, "attention_mask": torch.ones(width, dtype=torch.long), "loss_mask": loss_mask,
             "index": torch.tensor(index)}
        )  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def trained():
    """(target, drafter, untrained drafter): 60 AdamW steps of the training-time-test loss through Lightning."""
    target = sharp_target()
    torch.manual_seed(0)
    module = Eagle3Module(
        target, DraftVocab.full(VOCAB), "tiny_llama", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), ttt_steps=3
    )
    untrained = Eagle3Drafter(module.drafter.config)
    untrained.load_state_dict(module.drafter.state_dict())
    trainer = L.Trainer(
        max_steps=80,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(greedy_rows(target, 32, seed=0), batch_size=8, shuffle=True))
    return target, module.drafter.eval(), untrained.eval()


def mean_accepted(target, drafter, prompts, spec, new_tokens: int = 32) -> float:
    accepted = []
    for prompt in prompts:
        out = speculative_generate(target, Eagle3Proposer(drafter, target), prompt, spec, new_tokens)
        assert out.new_tokens.tolist() == greedy_reference(target, prompt, new_tokens).tolist()  # lossless
        accepted += out.stats.accepted_draft
    return sum(accepted) / len(accepted)


def test_a_briefly_trained_drafter_gets_drafts_accepted_on_unseen_prompts(trained):
    target, drafter, untrained = trained
    prompts = random_prompts(6, seed=123, min_len=4, max_len=4)  # not the training prompts
    spec = DynamicTreeSpec(depth=4, top_k=3, num_nodes=10)
    before = mean_accepted(target, untrained, prompts, spec)
    after = mean_accepted(target, drafter, prompts, spec)
    assert after > 0.6, (before, after)  # measured 0.88 of at most 4 per step, untrained 0.04
    assert after > before + 0.5, (before, after)
    static = mean_accepted(target, drafter, prompts, resolve_tree("small", None))
    assert static > 0.4, static


# ---------------------------------------------------------------------------------------------------------------------
# The drafter's own cache across accept/rewind steps


class RecordingProposer(Eagle3Proposer):
    """An `Eagle3Proposer` that records, at every step, the committed sequence and the tree it proposed."""

    def begin(self, prompt_ids, features, root, capacity):
        self.sequence, self.steps = prompt_ids.tolist() + [int(root)], []
        super().begin(prompt_ids, features, root, capacity)

    def accept(self, tokens, features, bonus):
        self.sequence += tokens[1:].tolist() + [int(bonus)]
        super().accept(tokens, features, bonus)

    def propose(self, spec):
        tree = super().propose(spec)
        self.steps.append((list(self.sequence), tree.tokens.tolist()))
        return tree


@torch.no_grad()
def from_scratch_chain(target, drafter, sequence: list[int], depth: int) -> list[int]:
    """The chain a drafter drafts after `sequence`, recomputed without any cache: the target's features of the whole
    sequence, the drafter causal over all its entries, then one path entry at a time fed its parent's state."""
    ids = torch.tensor([sequence])
    hidden = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i][0, :-1] for i in drafter.config.aux_layer_ids], dim=-1)  # [n, F]
    embed = target.get_input_embeddings()
    feature, embeds = drafter.fuse(features)[None], embed(ids[:, 1:])  # entry t: feature at t, token t + 1
    positions = torch.arange(len(sequence) - 1)[None]
    chain = []
    for _ in range(depth):
        state = drafter(feature, embeds, positions)[0, -1]  # causal over every entry so far
        token = int(drafter.token_ids[drafter.logits(state).argmax()])
        chain.append(token)
        feature = torch.cat([feature, state.view(1, 1, -1)], dim=1)
        embeds = torch.cat([embeds, embed(torch.tensor([[token]]))], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
    return chain


def test_the_drafters_cache_is_exact_across_accept_and_rewind_steps(trained):
    """At every step of a long generation (partial accepts, rewinds of the tree entries), the chain the proposer
    drafts over its cache equals the chain drafted from scratch after the committed sequence."""
    target, drafter, _ = trained
    proposer = RecordingProposer(drafter, target)
    chain = TokenTree.from_paths([[0] * d for d in range(1, 5)])
    prompt = random_prompts(1, seed=77, min_len=5, max_len=5)[0]
    out = speculative_generate(target, proposer, prompt, chain, 40)
    assert out.new_tokens.tolist() == greedy_reference(target, prompt, 40).tolist()
    accepted = out.stats.accepted_draft
    assert len(proposer.steps) >= 8 and len(set(accepted)) >= 2  # varied accepts: the rewinds differ
    for step, (sequence, tokens) in enumerate(proposer.steps):
        assert tokens[0] == sequence[-1]
        assert tokens[1:] == from_scratch_chain(target, drafter, sequence, 4), f"step {step}"
