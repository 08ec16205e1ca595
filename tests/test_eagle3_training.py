"""Training the EAGLE-3-style drafter: the training-time-test loss falls and overfits a small batch; checkpoints hold
the drafter only."""

from functools import partial

import torch

from medusa_like.drafters.base import CHECKPOINT_KEY
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.training.eagle3_module import Eagle3Module

from .conftest import VOCAB, tiny_target


def small_batch(seed: int = 0, rows: int = 4, width: int = 24) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (rows, width), generator=g)
    attention_mask = torch.ones(rows, width, dtype=torch.long)
    attention_mask[0, width - 5 :] = 0  # one padded row
    loss_mask = attention_mask.clone()
    loss_mask[:, :4] = 0  # a "prompt" without labels
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "index": torch.arange(rows),
    }


def make_module(vocab: DraftVocab | None = None, steps: int = 3) -> Eagle3Module:
    target = tiny_target("llama")
    with torch.no_grad():  # a random tiny model is nearly uniform: sharpen it so its distributions can be learned
        target.get_output_embeddings().weight.mul_(20)
    return Eagle3Module(
        target,
        vocab or DraftVocab.full(VOCAB),
        "tiny_llama",
        optimizer=partial(torch.optim.AdamW, lr=3e-3),
        ttt_steps=steps,
    )


def test_training_time_test_loss_falls_and_overfits_a_batch():
    torch.manual_seed(0)
    module = make_module()
    batch = small_batch()
    optimizer = module.configure_optimizers()
    first, _, first_acc = module._forward(batch)
    for _ in range(150):
        loss, per_step, accuracy = module._forward(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    last, per_step, accuracy = module._forward(batch)
    assert last < 0.5 * first, (first.item(), last.item())
    hits, _, count = accuracy[0]
    assert hits / count > 0.9  # depth 1 reproduces the target's argmax on the batch it saw
    assert hits / count > first_acc[0][0] / first_acc[0][2]
    assert per_step.shape == (3,)


def test_only_the_drafter_trains_and_is_checkpointed():
    module = make_module(DraftVocab(torch.arange(0, VOCAB, 2), VOCAB))
    target_before = {k: v.clone() for k, v in module.target.state_dict().items()}
    optimizer = module.configure_optimizers()
    loss, _, _ = module._forward(small_batch(1))
    loss.backward()
    optimizer.step()
    assert all(torch.equal(v, module.target.state_dict()[k]) for k, v in target_before.items())
    assert all(k.startswith("drafter.") for k in module.state_dict())
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    meta = checkpoint[CHECKPOINT_KEY]
    assert meta["kind"] == "eagle3" and meta["draft_token_ids"] == list(range(0, VOCAB, 2))
    assert meta["config"]["draft_vocab_size"] == len(range(0, VOCAB, 2))
