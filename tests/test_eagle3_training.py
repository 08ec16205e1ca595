"""Training the EAGLE-3-style drafter: the training-time-test loss falls and overfits a small batch; checkpoints hold
the drafter only."""

from functools import partial

import pytest
import torch

from medusa_like.drafters.base import CHECKPOINT_KEY
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.training.eagle3_module import Eagle3Module
from medusa_like.training.losses import shift_left
from medusa_like.training.ttt import supervised_rows

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


@pytest.mark.slow
def test_training_time_test_loss_falls_and_overfits_a_batch():
    torch.manual_seed(0)
    module = make_module()
    batch = small_batch()
    optimizer = module.configure_optimizers()
    first, _, first_acc, _ = module._forward(batch)
    for _ in range(150):
        loss, per_step, accuracy, _ = module._forward(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    last, per_step, accuracy, _ = module._forward(batch)
    assert last < 0.5 * first, (first.item(), last.item())
    hits, _, count = accuracy[0]
    assert hits / count > 0.9  # depth 1 reproduces the target's argmax on the batch it saw
    assert hits / count > first_acc[0][0] / first_acc[0][2]
    assert per_step.shape == (3,)


def test_only_the_drafter_trains_and_is_checkpointed():
    module = make_module(DraftVocab(torch.arange(0, VOCAB, 2), VOCAB))
    target_before = {k: v.clone() for k, v in module.target.state_dict().items()}
    optimizer = module.configure_optimizers()
    loss, _, _, _ = module._forward(small_batch(1))
    loss.backward()
    optimizer.step()
    assert all(torch.equal(v, module.target.state_dict()[k]) for k, v in target_before.items())
    assert all(k.startswith("drafter.") for k in module.state_dict())
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    meta = checkpoint[CHECKPOINT_KEY]
    assert meta["kind"] == "eagle3" and meta["draft_token_ids"] == list(range(0, VOCAB, 2))
    assert meta["config"]["draft_vocab_size"] == len(range(0, VOCAB, 2))


def test_validation_reports_the_share_of_rows_the_draft_vocabulary_covers():
    """The accuracies count only supervised rows whose target argmax is a draft token; `vocab_coverage` is the share
    of supervised rows that are (1 with the whole vocabulary), so drafters with different vocabularies compare by
    accuracy x coverage."""
    batch = small_batch(2)
    for vocab in (DraftVocab.full(VOCAB), DraftVocab(torch.arange(0, VOCAB, 2), VOCAB)):
        module = make_module(vocab)
        module.validation_step(batch, 0)
        wanted = supervised_rows(batch["loss_mask"], batch["attention_mask"])  # [B, T]
        with torch.no_grad():
            argmax = module.target(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
        labelled = wanted & torch.isin(argmax, vocab.token_ids)  # [B, T]
        coverage = module.val_metrics["vocab_coverage"].compute()
        torch.testing.assert_close(coverage, labelled.sum() / wanted.sum())
        depth1_rows = module.val_metrics["acc_top1_depth1"].weight  # the accuracy's own denominator
        assert int(depth1_rows) == int(shift_left(labelled, 1, fill=False).sum())
    assert 0 < coverage < 1  # even ids only: about half the rows


def test_train_on_all_labels_every_real_token_in_training_and_only_the_assistant_in_validation():
    """`train_on="all"`: a training step's loss counts a row for every position predicting a real token (the prompt's
    too), as many as with a loss_mask of ones; validation still counts the assistant's tokens only."""
    batch = small_batch(3)
    everything = {**batch, "loss_mask": batch["attention_mask"].clone()}
    torch.manual_seed(0)
    assistant = make_module(steps=1)
    torch.manual_seed(0)
    every = make_module(steps=1)
    every.train_on = "all"
    rows = lambda module, b, training: int(module._forward(b, training=training)[2][0][2])  # noqa: E731
    assert rows(every, batch, True) == rows(assistant, everything, True) > rows(assistant, batch, True)
    assert rows(every, batch, False) == rows(assistant, batch, False) == rows(assistant, batch, True)
    torch.testing.assert_close(every._forward(batch, training=True)[0], assistant._forward(everything)[0])
    with pytest.raises(ValueError, match="train_on must be one of assistant, all"):
        Eagle3Module(tiny_target("llama"), DraftVocab.full(VOCAB), "t", optimizer=torch.optim.AdamW, train_on="user")


def test_without_the_vocabulary_check_training_projects_onto_the_draft_vocabulary_only():
    """`vocab_check=False`: training's labels are the same top-k of the draft vocabulary's logits, every supervised row
    is labelled (rows whose target argmax is not a draft token too), the target's whole output projection is never
    run; validation keeps EAGLE-3's rule."""
    batch = small_batch(4)
    module = make_module(DraftVocab(torch.arange(0, VOCAB, 2), VOCAB), steps=1)
    wanted = module._wanted(batch, training=True)
    checked = module._compute_target_outputs(batch, wanted)
    projections = []
    module.target.get_output_embeddings().register_forward_pre_hook(lambda *_: projections.append(1))
    module.vocab_check = False
    module.train()
    unchecked = module._target_outputs(batch, wanted)
    assert not projections  # the draft rows were projected alone, not through the whole lm_head
    assert torch.equal(unchecked["labelled"], wanted) and not torch.equal(checked["labelled"], wanted)
    assert torch.equal(unchecked["topk_ids"], checked["topk_ids"])
    torch.testing.assert_close(unchecked["topk_logp"], checked["topk_logp"])
    module.eval()
    assert torch.equal(module._target_outputs(batch, wanted)["labelled"], checked["labelled"]) and projections


def test_a_frozen_projection_keeps_the_targets_rows_while_the_rest_trains():
    """`freeze_lm_head=true`: after optimizer steps the projection still holds the target's rows of the draft
    vocabulary while the decoder layer moved; without the target's rows to keep it is refused."""
    target = tiny_target("llama")
    vocab = DraftVocab(torch.arange(0, VOCAB, 2), VOCAB)
    common = dict(optimizer=partial(torch.optim.AdamW, lr=3e-3), ttt_steps=2)
    module = Eagle3Module(target, vocab, "tiny_llama", freeze_lm_head=True, **common)
    rows = target.get_output_embeddings().weight[vocab.token_ids].detach().clone()
    layer = module.drafter.mlp.down_proj.weight.detach().clone()
    optimizer = module.configure_optimizers()
    for seed in range(2):
        loss, _, _, _ = module._forward(small_batch(seed))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.equal(module.drafter.lm_head.weight, rows)
    assert not torch.equal(module.drafter.mlp.down_proj.weight, layer)
    with pytest.raises(ValueError, match="freeze_lm_head=true keeps the target's rows"):
        Eagle3Module(target, vocab, "tiny_llama", freeze_lm_head=True, init_from_target=False, **common)


def test_a_layer_started_from_the_target_computes_that_layer_on_the_high_stream():
    """`init_layer_from_target(target, i)` with the high aux stream entering layer i: the drafter's step equals the
    target's layer i on that stream (hidden_states[i + 1]), whatever the token embeddings."""
    from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    target = tiny_target("llama", num_hidden_layers=3)
    config = Eagle3Config.for_target(target.config, VOCAB, aux_layer_ids=[0, 1, 1])
    drafter = Eagle3Drafter(config)
    batch = small_batch(rows=1)
    ids = batch["input_ids"]
    hidden = target(ids, output_hidden_states=True).hidden_states  # [L + 1] x [1, T, h]
    aux = torch.cat([hidden[0], hidden[1], hidden[1]], dim=-1)
    positions = torch.arange(ids.shape[1])[None]
    embeds = torch.randn_like(hidden[0])
    before = drafter(drafter.fuse(aux), embeds, positions)
    drafter.init_layer_from_target(target, 1)
    after = drafter(drafter.fuse(aux), embeds, positions)
    torch.testing.assert_close(after, hidden[2], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, hidden[2], atol=1e-2)  # a random layer does not


def test_the_embedding_half_starts_at_zero_or_as_the_feature_half_where_named():
    """`init_embedding_from_feature`: the named projections' embedding half holds the started layer's weights, the
    others' is zero, so only the named ones let the next token's embedding in at the first step; an unknown name, or
    the option without a layer from the target, is refused."""
    target = tiny_target("llama", num_hidden_layers=3)
    common = dict(optimizer=partial(torch.optim.AdamW, lr=3e-3), aux_layer_ids=[0, 1, 2], init_layer_from_target=2)
    module = Eagle3Module(
        target, DraftVocab.full(VOCAB), "tiny_llama", init_embedding_from_feature=["v_proj"], **common
    )
    attn, source = module.drafter.self_attn, target.base_model.layers[2].self_attn
    hidden = target.config.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        weight, theirs = getattr(attn, name).weight, getattr(source, name).weight
        torch.testing.assert_close(weight[:, hidden:], theirs)
        if name == "v_proj":
            torch.testing.assert_close(weight[:, :hidden], theirs)
        else:
            assert not weight[:, :hidden].any()
    with pytest.raises(ValueError, match="embedding_from_feature names projections of"):
        Eagle3Module(target, DraftVocab.full(VOCAB), "tiny_llama", init_embedding_from_feature=["o_proj"], **common)
    with pytest.raises(ValueError, match="it needs a layer from the target"):
        Eagle3Module(target, DraftVocab.full(VOCAB), "tiny_llama", optimizer=common["optimizer"],
                     init_layer_from_target=None, init_embedding_from_feature=["v_proj"])  # fmt: skip


def test_high_starts_the_layer_the_last_aux_stream_enters_and_bad_names_are_refused():
    """`init_layer_from_target="high"` (the default recipe's) is the layer the last aux stream enters, which `fc`
    passes through; anything but an index, "high" or null is refused when the module is built."""
    from medusa_like.training.eagle3_module import layer_index

    target = tiny_target("llama", num_hidden_layers=4)
    module = Eagle3Module(
        target,
        DraftVocab.full(VOCAB),
        "tiny_llama",
        optimizer=partial(torch.optim.AdamW, lr=3e-3),
        aux_layer_ids=[0, 1, 2],
        init_layer_from_target="high",
    )
    source = target.base_model.layers[2]
    torch.testing.assert_close(module.drafter.mlp.down_proj.weight, source.mlp.down_proj.weight)
    assert not torch.equal(module.drafter.mlp.down_proj.weight, target.base_model.layers[1].mlp.down_proj.weight)
    assert layer_index(3, (0, 1, 2), 4) == 3
    assert layer_index("high", (0, 1, 4), 4) is None  # the target's output enters no layer: the layer starts random
    for bad in ("top", True, 1.5):
        with pytest.raises(ValueError, match="init_layer_from_target must be a target layer index, 'high' or null"):
            layer_index(bad, (0, 1, 2), 4)
    assert layer_index(None, (0, 1, 2), 4) is None
    with pytest.raises(ValueError, match="init_layer_from_target must be a target layer index, 'high' or null"):
        Eagle3Module(target, DraftVocab.full(VOCAB), "tiny_llama", optimizer=partial(torch.optim.AdamW, lr=3e-3),
                     init_layer_from_target="top")  # fmt: skip
