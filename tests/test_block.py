"""The block drafter (DFlash-style): lossless decoding on every family, backend and tree kind, what a branch means for
a tree drafted from one block, training that supervises many positions per read and serves what it trained, and its
files in the layout the serving engines load."""

import json
from functools import partial

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from medusa_like import MedusaLikeModel, export_drafter, load_drafter
from medusa_like.decoding.generate import speculative_generate
from medusa_like.decoding.tree import DynamicTreeSpec
from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.base import DrafterMismatchError
from medusa_like.drafters.block import BlockConfig, BlockDrafter, fresh_block
from medusa_like.drafters.block_attention import BlockMask, block_attention
from medusa_like.drafters.block_proposer import BlockProposer
from medusa_like.drafters.combined import CombinedDrafter
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.formats.common import FormatError
from medusa_like.training.block_module import BlockModule, block_visibility, sample_anchors

from .conftest import VOCAB, flat_cost, greedy_rows, random_prompts, stock_greedy, tiny_target, untouched_target

BACKENDS = ["eager", "sdpa", "flash"]
TREES = {
    "chain": lambda: resolve_tree("chain", 7),
    "small": lambda: resolve_tree("small", 7),
    "dynamic": lambda: DynamicTreeSpec(depth=5, top_k=3, num_nodes=10),
}
NEW_TOKENS = 20


def random_block(target, vocab: DraftVocab | None = None, seed: int = 0, **options) -> BlockDrafter:
    """A drafter with random weights large enough that its guesses vary (and are sometimes right)."""
    torch.manual_seed(seed)
    size = vocab.size if vocab is not None else VOCAB
    config = BlockConfig.for_target(target.config, size, **{"feature_layers": (1, 2, 2), **options})
    drafter = BlockDrafter(config, vocab)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return drafter.eval()


_trained: dict = {}


def trained_block(family: str) -> tuple:
    """A target of `family` and a block drafter trained for a few seconds on its own greedy answers: its drafts are
    often right (the tiny targets repeat themselves), so decoding runs the accepting paths too."""
    if family not in _trained:
        torch.manual_seed(0)
        target = tiny_target(family)
        rows = greedy_rows(target, 16, seed=7)
        batch = {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
        module = BlockModule(
            target, DraftVocab.full(VOCAB), "tiny", optimizer=partial(torch.optim.AdamW, lr=3e-3), anchors=16,
            feature_layers=[1, 2, 2], loss="soft_ce",
        )  # fmt: skip
        optimizer = module.configure_optimizers()
        for _ in range(60):
            loss, _, _, _ = module._forward(batch, training=True)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        _trained[family] = module.target, module.drafter.eval()
    return _trained[family]


def references(family: str, count: int = 8) -> tuple:
    """Random prompts and transformers' own greedy answers on an untouched target of `family`."""
    prompts = random_prompts(count, seed=5, min_len=1, max_len=30)
    return prompts, stock_greedy(untouched_target(family), prompts, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("tree_name", sorted(TREES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_greedy_equals_target_greedy(family, backend, tree_name):
    """A random block drafter (sometimes right on these repetitive tiny targets) decodes the target's greedy output
    token for token, with some drafts accepted, so the matrix does not exercise only the all-rejected path."""
    target, drafter = trained_block(family)
    prompts, expected = references(family)
    proposer = BlockProposer(drafter, target)
    accepted = 0
    for prompt, reference in zip(prompts, expected, strict=True):
        out = speculative_generate(target, proposer, prompt, TREES[tree_name](), NEW_TOKENS, backend=backend)
        assert out.new_tokens.tolist() == reference, f"prompt of length {prompt.shape[1]}"
        accepted += sum(out.stats.accepted_draft)
    assert accepted > 0, "no draft token was ever accepted: only the all-rejected path was tested"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_block_through_the_api_alone_and_combined_with_lookup_equals_greedy(family):
    """`from_pretrained(drafter=<block drafter>)` and the combined tree (block + lookup, one cost-aware tree) on the
    prepared target: greedy's tokens on every prompt, and a reduced draft vocabulary is never left."""
    target = tiny_target(family)
    prompts, expected = references(family, count=5)
    vocab = DraftVocab(torch.arange(0, VOCAB, 2), VOCAB)
    drafter = random_block(target, vocab, seed=1)
    alone = MedusaLikeModel(target, None, drafter, backend="sdpa")
    combined = CombinedDrafter(drafter, LookupDrafter(), flat_cost(alone.target))
    together = MedusaLikeModel(alone.forward, None, combined)
    for prompt, reference in zip(prompts, expected, strict=True):
        for model, tree in ((alone, "dynamic"), (together, DynamicTreeSpec(depth=3, top_k=2, num_nodes=6))):
            out = model.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[], tree=tree)
            assert out.new_tokens.tolist() == reference
    proposer = drafter.proposer(alone.target)
    proposer.begin(prompts[0][0], torch.randn(prompts[0].shape[1], 3 * 32), torch.tensor(3), 64)
    tree = proposer.propose(DynamicTreeSpec(depth=4, top_k=4, num_nodes=12))
    assert all(int(t) % 2 == 0 for t in tree.tokens[1:])  # every drafted token is in the draft vocabulary


def test_a_branch_is_a_positions_candidates_the_same_after_every_node_of_a_depth():
    """A tree from one block: position j's distribution is conditioned on the context and the root alone, so every
    node at depth j - 1 gets the same children, position j's top-k (scored by the product of the positions'
    probabilities along the path), whatever token was drafted at j - 1."""
    target = tiny_target("qwen2")
    drafter = random_block(target, seed=2)
    proposer = drafter.proposer(target)
    prompt = random_prompts(1, seed=3, min_len=9, max_len=9)[0][0]
    proposer.begin(prompt, torch.randn(9, 3 * 32), torch.tensor(4), 64)
    logp = proposer.block_log_probs(drafter.max_depth)  # [B - 1, N]: what one forward gives
    tree = proposer.propose(DynamicTreeSpec(depth=3, top_k=3, num_nodes=13))
    top = logp.topk(3, dim=-1)
    for node in range(1, tree.num_nodes):
        depth = int(tree.depth[node])
        assert int(tree.tokens[node]) in top.indices[depth - 1].tolist()
        parent = int(tree.parents[node])
        rank = top.indices[depth - 1].tolist().index(int(tree.tokens[node]))
        expected = float(tree.logp[parent]) + float(top.values[depth - 1, rank])
        assert float(tree.logp[node]) == pytest.approx(expected)  # the product of the positions' probabilities
    by_depth: dict[int, set] = {}
    for node in range(1, tree.num_nodes):
        children = {int(tree.tokens[c]) for c in tree.children[node]}
        if len(children) == 3:  # every expanded node of a depth got the same three candidates
            by_depth.setdefault(int(tree.depth[node]), set()).add(frozenset(children))
    assert by_depth and all(len(sets) == 1 for sets in by_depth.values())


# ---------------------------------------------------------------------------------------------------------------------
# Training


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


def make_module(target=None, **options) -> BlockModule:
    target = target if target is not None else tiny_target("llama")
    with torch.no_grad():  # a random tiny model is nearly uniform: sharpen it so its distributions can be learned
        target.get_output_embeddings().weight.mul_(20)
    options = {"block_size": 4, "anchors": 8, "feature_layers": [1, 2, 2], **options}
    return BlockModule(target, DraftVocab.full(VOCAB), "tiny", optimizer=partial(torch.optim.AdamW, lr=3e-3), **options)


@pytest.mark.slow
def test_the_block_loss_falls_and_overfits_a_batch():
    torch.manual_seed(0)
    module = make_module()
    batch = small_batch()
    optimizer = module.configure_optimizers()
    first, _, first_accuracy, _ = module._forward(batch, training=True)
    for _ in range(150):
        loss, _, _, _ = module._forward(batch, training=True)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    last, per_position, accuracy, _ = module._forward(batch, training=True)  # the same anchors: step 0's draw
    assert last < 0.5 * first, (first.item(), last.item())
    for hits, _, _, count in accuracy:  # every position reproduces the target's argmax on the rows it saw
        assert hits / count > 0.8
    assert per_position.shape == (3,) and first_accuracy[0][0] / first_accuracy[0][3] < 0.5


def test_what_training_computes_for_a_block_is_what_decoding_drafts():
    """The training forward's logits at a block (context before its anchor, one forward over many blocks) equal the
    proposer's after it commits the same features and drafts from the same root: what is trained is what is served."""
    torch.manual_seed(0)
    module = make_module(tiny_target("gemma3"), block_size=5, anchors=3)
    drafter = module.drafter.eval()
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.2)
    batch = small_batch(2, rows=2, width=20)
    out = module._compute_target_outputs(batch, module._wanted(batch, training=True))
    anchors = torch.tensor([[3, 9, 14], [1, 6, 12]])
    with torch.no_grad():
        trained = drafter.logits(module.block_states(out["aux"], batch["input_ids"], batch["attention_mask"], anchors))
    for row in range(2):
        for n, anchor in enumerate(anchors[row].tolist()):
            proposer = drafter.proposer(module.target)
            ids = batch["input_ids"][row]
            proposer.begin(ids[:anchor], out["aux"][row, :anchor], ids[anchor], capacity=32)
            served = proposer.block_log_probs(4)  # [B - 1, N]
            torch.testing.assert_close(served, trained[row, n].float().log_softmax(-1), rtol=1e-4, atol=1e-4)


def test_the_anchors_and_the_block_mask():
    valid = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    spread = sample_anchors(valid, 3)
    assert spread[0].tolist() == [1, 4, 6] and spread[1].tolist() == [-1, -1, 2]  # evenly spread, -1 where too few
    drawn = sample_anchors(valid, 3, torch.Generator().manual_seed(0))
    assert set(drawn[0].tolist()) <= {1, 2, 4, 5, 6} and len(set(drawn[0].tolist())) == 3
    assert torch.equal(drawn, sample_anchors(valid, 3, torch.Generator().manual_seed(0)))  # the same seed draws alike
    attention = torch.ones(1, 6, dtype=torch.long)
    attention[0, 5] = 0
    visible = block_visibility(torch.tensor([[2, 4]]), attention, size=2).dense()[0, 0]  # [4, 6 + 4]
    assert visible[:2, :6].tolist() == [[True, True, False, False, False, False]] * 2  # block 1: context before 2
    assert visible[2:, :6].tolist() == [[True, True, True, True, False, False]] * 2  # block 2: before 4
    assert visible[:, 6:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


def test_the_block_attention_equals_sdpa_over_the_dense_mask_and_its_gradients_too():
    """Training's attention part by part (context keys, then the own block's) equals transformers' SDPA over the same
    visibility as a dense mask, grouped-query heads included, forward and backward."""
    g = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, blocks, size, width, dim = 2, 2, 3, 4, 3, 7, 8
    rows = blocks * size
    query = torch.randn(batch, kv_heads * groups, rows, dim, generator=g, requires_grad=True)
    key = torch.randn(batch, kv_heads, width + rows, dim, generator=g, requires_grad=True)
    value = torch.randn(batch, kv_heads, width + rows, dim, generator=g, requires_grad=True)
    context = torch.rand(batch, rows, width, generator=g) < 0.5
    context[:, :size] = False  # a block that sees no context: its own block alone
    mask = BlockMask(context, size)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, False
    ours, _ = block_attention(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask.dense(), scaling=0.3)
    torch.testing.assert_close(ours, theirs)
    grads = torch.autograd.grad(ours.square().sum(), (query, key, value))
    expected = torch.autograd.grad(theirs.square().sum(), (query, key, value))
    for mine, reference in zip(grads, expected, strict=True):
        torch.testing.assert_close(mine, reference)


def test_only_the_drafter_trains_and_checkpoints_record_the_kind():
    module = make_module()
    before = {k: v.clone() for k, v in module.target.state_dict().items()}
    optimizer = module.configure_optimizers()
    loss, _, _, _ = module._forward(small_batch(1), training=True)
    loss.backward()
    optimizer.step()
    assert all(torch.equal(v, module.target.state_dict()[k]) for k, v in before.items())
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    meta = checkpoint["medusa_like"]
    assert meta["kind"] == "block" and meta["config"]["block_size"] == 4 and meta["config"]["mask_token_id"] is None


# ---------------------------------------------------------------------------------------------------------------------
# Files


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_native_and_dflash_exports_read_back_exactly(tmp_path, family):
    """Both layouts round-trip every tensor and the draft vocabulary; the DFlash one without our section (as an engine
    or another trainer wrote it) too, its `target_layer_ids` naming layer outputs (our feature layers minus one)."""
    target = tiny_target(family)
    vocab = DraftVocab(torch.arange(0, VOCAB, 3), VOCAB)
    drafter = random_block(target, vocab, num_layers=2)
    for fmt in ("native", "dflash"):
        back = load_drafter(export_drafter(drafter, tmp_path / fmt, fmt, target, "tiny"), target)
        assert torch.equal(back.token_ids, drafter.token_ids) and back.config == drafter.config
        assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["target_layer_ids"] == [0, 1, 1] and config["dflash_config"]["block_size"] == 8
    del config["medusa_like"]
    (tmp_path / "dflash" / "config.json").write_text(json.dumps(config))
    back = load_drafter(tmp_path / "dflash", target)
    assert back.config.feature_layers == (1, 2, 2) and back.config.mask_token_id is None  # mask_embedding shipped
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())


def test_a_learned_mask_embedding_ships_where_vllm_reads_it_and_reads_back_from_there(tmp_path):
    """vLLM reads a DFlash drafter's own mask embedding from `mask_embedding.pt` only (a `mask_embedding` tensor in the
    weights file it drops, and drafts from the mask token's embedding instead): the export writes it there, for the
    mask token its config names, and a directory with the embedding there alone reads back the same drafter."""
    from safetensors.torch import load_file, save_file

    target = tiny_target("llama")
    drafter = random_block(target)
    out = export_drafter(drafter, tmp_path / "dflash", "dflash", target, "tiny")
    config = json.loads((out / "config.json").read_text())
    shipped = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert shipped["mask_token_id"] == config["dflash_config"]["mask_token_id"]
    assert torch.equal(shipped["embedding"], drafter.mask_embedding.detach())
    assert not (export_drafter(drafter, tmp_path / "native", "native", target, "tiny") / "mask_embedding.pt").exists()
    del config["medusa_like"]
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    del tensors["mask_embedding"]
    save_file(tensors, out / "model.safetensors")
    back = load_drafter(out, target)
    assert back.config.mask_token_id is None and torch.equal(back.mask_embedding, drafter.mask_embedding)
    torch.save({**shipped, "mask_token_id": shipped["mask_token_id"] - 1}, out / "mask_embedding.pt")
    with pytest.raises(FormatError, match="mask token"):
        load_drafter(out, target)


def test_a_reference_dflash_drafter_without_its_own_head_reads_with_the_targets(tmp_path):
    """The reference drafters share the target's head and fill the block with a mask token's embedding: read
    without lm_head.weight, mask_embedding or d2t, with the target's rows as the head and the token's embedding."""
    target = tiny_target("llama")
    drafter = random_block(target, mask_token_id=7)
    out = export_drafter(drafter, tmp_path / "dflash", "dflash", target, "tiny")
    config = json.loads((out / "config.json").read_text())
    del config["medusa_like"], config["draft_vocab_size"]
    (out / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    back = load_drafter(out, target)
    assert back.config.mask_token_id == 7 and back.mask_embedding is None
    assert torch.equal(back.lm_head.weight, target.get_output_embeddings().weight.detach())


def test_bad_block_drafters_are_refused_in_one_line(tmp_path):
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="mask_token_id 500 lies outside the target's vocabulary of 97"):
        fresh_block(target, mask_token_id=500)
    with pytest.raises(ValueError, match="block_size must be an integer >= 2"):
        fresh_block(target, block_size=1)
    wide = tiny_target("llama", hidden_size=48)
    with pytest.raises(DrafterMismatchError, match="reads hidden size 32, but target .* has hidden size 48"):
        MedusaLikeModel(wide, None, random_block(target))
    out = export_drafter(random_block(target, mask_token_id=7), tmp_path / "d", "dflash", target, "tiny")
    with pytest.raises(DrafterMismatchError, match="hidden size"):
        load_drafter(out, wide)
    config = json.loads((out / "config.json").read_text())
    del config["medusa_like"]
    config["dflash_config"]["mask_token_id"] = 1000
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="mask_token_id 1000 lies outside the target's vocabulary"):
        load_drafter(out, target)
    config["medusa_like"] = {"kind": "eagle3"}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="contradicts itself.*DFlashDraftModel.*'eagle3'"):
        load_drafter(out, target)
    long = tiny_target("llama", max_position_embeddings=6)
    with pytest.raises(DrafterMismatchError, match="block of 8 positions.*max_position_embeddings \\(6\\)"):
        MedusaLikeModel(long, None, random_block(long))


def test_with_the_predecessor_head_a_branch_follows_its_parent_and_decoding_stays_lossless(tmp_path):
    """The predecessor head rescores position j by the token before it: each frontier node's children are the top-k
    of its own rescored distribution (one block forward a step still), training teacher-forces the true predecessor,
    and what decoding drafts is what training computes; the output stays greedy's; the native files keep the head,
    the DFlash layout (which has no place for it) refuses it."""
    torch.manual_seed(0)
    module = make_module(tiny_target("llama"), block_size=4, anchors=3, predecessor_rank=4)
    drafter = module.drafter.eval()
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.5)
    batch = small_batch(4, rows=1, width=16)
    out = module._compute_target_outputs(batch, module._wanted(batch, training=True))
    anchors = torch.tensor([[5]])
    ids = batch["input_ids"][0]
    with torch.no_grad():
        state = module.block_states(out["aux"], batch["input_ids"], batch["attention_mask"], anchors)[0, 0]  # [3, h]
        trained = drafter.logits(state, ids[5:8]).float().log_softmax(-1)  # predecessors: the root, then true tokens
    proposer = drafter.proposer(module.target)
    proposer.begin(ids[:5], out["aux"][0, :5], ids[5], capacity=32)
    torch.testing.assert_close(proposer.block_log_probs(3, ids[5:8]), trained, rtol=1e-4, atol=1e-4)
    proposer = drafter.proposer(module.target)
    proposer.begin(ids[:5], out["aux"][0, :5], ids[5], capacity=32)
    tree = proposer.propose(DynamicTreeSpec(depth=3, top_k=3, num_nodes=12))
    siblings = {frozenset(int(tree.tokens[c]) for c in tree.children[n]) for n in range(1, tree.num_nodes)
                if int(tree.depth[n]) == 1 and len(tree.children[n]) == 3}  # fmt: skip
    assert len(siblings) > 1  # different parents, different children
    target = tiny_target("llama")
    prompts, expected = references("llama", count=3)
    model = MedusaLikeModel(target, None, random_block(target, predecessor_rank=4), backend="sdpa")
    for prompt, reference in zip(prompts, expected, strict=True):
        for tree in ("dynamic", "small"):
            assert model.generate(
                prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[], tree=tree
            ).new_tokens.tolist() == (reference)
    target = module.target
    back = load_drafter(export_drafter(drafter, tmp_path / "native", "native", target, "tiny"), target)
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())
    with pytest.raises(FormatError, match="predecessor head .* no place in the DFlash layout"):
        export_drafter(drafter, tmp_path / "dflash", "dflash", target, "tiny")
