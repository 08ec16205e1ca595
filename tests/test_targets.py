"""The target's output projection has one rule: training applies the final-logit soft-capping (Gemma 2-style
`final_logit_softcapping`) exactly as the target's own forward and inference's `VocabProjection` do."""

from functools import partial

import pytest
import torch

from medusa_like.decoding.projection import VocabProjection
from medusa_like.drafters.medusa import HeadsConfig
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.targets import output_logits
from medusa_like.tiny import tiny_model
from medusa_like.training.eagle3_module import Eagle3Module
from medusa_like.training.medusa_module import MedusaHeadsModule

VOCAB = 61
CAP = 1.5  # far below the tiny model's raw logits once sharpened: capping changes every distribution


def capped_target():
    """A tiny Gemma-3 target whose logits are soft-capped, with a projection sharp enough for the cap to matter."""
    target = tiny_model("gemma3", VOCAB, seed=3, final_logit_softcapping=CAP, tie_word_embeddings=False)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(30)
    return target


def batch(rows: int = 2, width: int = 12) -> dict:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (rows, width), generator=g)  # [B, T]
    ones = torch.ones(rows, width, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": ones, "loss_mask": ones, "index": torch.arange(rows)}


def forward_logits(target, input_ids):
    """The target's own logits [B, T, V] (transformers caps them) and its last hidden states [B, T, H]."""
    with torch.no_grad():
        out = target(input_ids=input_ids, output_hidden_states=True)
    return out.logits, out.hidden_states[-1]


def test_the_cap_changes_the_logits_and_every_projection_applies_it():
    target = capped_target()
    logits, hidden = forward_logits(target, batch()["input_ids"])
    raw = target.get_output_embeddings()(hidden)
    assert raw.abs().max() > 5 * CAP and logits.abs().max() <= CAP  # the cap is active here
    torch.testing.assert_close(output_logits(target, hidden), logits)
    torch.testing.assert_close(VocabProjection(target)(hidden), logits, rtol=1e-4, atol=1e-5)


def test_medusa_training_projects_heads_and_teachers_through_the_capped_projection():
    target = capped_target()
    config = HeadsConfig(target.config.hidden_size, VOCAB, num_heads=2)
    module = MedusaHeadsModule(target, config, "tiny_gemma3", optimizer=partial(torch.optim.AdamW), kl_weight=0.5)
    logits, hidden = forward_logits(target, batch()["input_ids"])
    torch.testing.assert_close(module._project(hidden), logits)  # the KL teacher and the heads' shared projection
    heads_logits = module.heads(hidden[0], module._project)  # [K, T, V]
    assert heads_logits.abs().max() <= CAP


@pytest.mark.parametrize("draft_size", [VOCAB, 20])
def test_eagle3_labels_are_the_capped_target_distribution(draft_size):
    target = capped_target()
    data = batch()
    counts = torch.bincount(data["input_ids"].flatten(), minlength=VOCAB).float()
    vocab = DraftVocab.from_counts(counts, draft_size)
    module = Eagle3Module(
        target, vocab, "tiny_gemma3", optimizer=partial(torch.optim.AdamW), aux_layer_ids=[0, 1, 2], top_k=None
    )
    wanted = torch.ones_like(data["attention_mask"], dtype=torch.bool)  # [B, T]
    out = module._target_outputs(data, wanted)
    labelled = out["labelled"]
    teacher_logp = torch.zeros_like(out["topk_logp"]).scatter(-1, out["topk_ids"], out["topk_logp"])  # [B, T, N]
    logits, _ = forward_logits(target, data["input_ids"])  # [B, T, V], capped by transformers
    expected = logits[..., vocab.token_ids].float().log_softmax(-1)  # [B, T, N]
    torch.testing.assert_close(teacher_logp, expected, rtol=1e-4, atol=1e-5)
    uncapped = target.get_output_embeddings()(forward_logits(target, data["input_ids"])[1])
    assert not torch.allclose(teacher_logp, uncapped[..., vocab.token_ids].log_softmax(-1), atol=1e-2)
    in_vocab = torch.isin(logits.argmax(-1), vocab.token_ids)  # [B, T]
    assert torch.equal(labelled, in_vocab)
