"""The EAGLE-3 serving layout (vLLM, SGLang): exact export, strict import, and the layout itself.

The expected key names, shapes and config keys below are written out from the engines' loaders' documented layout,
not derived from the exporter; the single-position forward is computed from the exported tensors alone.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from medusa_like import DrafterMismatchError, DraftVocab, Eagle3Config, Eagle3Drafter, export_drafter, load_drafter
from medusa_like.formats.common import FormatError

from .conftest import HIDDEN, VOCAB, tiny_target

DRAFT = 40  # draft vocabulary size


def drafter_for(target, seed: int = 0) -> Eagle3Drafter:
    vocab = DraftVocab(torch.arange(0, 2 * DRAFT, 2), VOCAB)
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, DRAFT), vocab)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return drafter.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_hidden_layers=8)  # aux layers 2, 4, 5: strictly increasing, as vLLM reads them


@pytest.fixture
def exported(target, tmp_path):
    drafter = drafter_for(target)
    return drafter, export_drafter(drafter, tmp_path / "eagle3", "eagle3", target, "tiny/llama")


def expected_layout(target) -> dict:
    h, heads, kv = HIDDEN, target.config.num_attention_heads, target.config.num_key_value_heads
    d, inter = h // heads, target.config.intermediate_size
    return {
        "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * d),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "fc.weight": (h, 3 * h),
        "norm.weight": (h,),
        "lm_head.weight": (DRAFT, h),
        "d2t": (DRAFT,),
        "t2d": (VOCAB,),
    }


def test_layout_and_config_match_the_engines(exported, target):
    _, out = exported
    tensors = load_file(out / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_layout(target)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert (torch.arange(DRAFT) + tensors["d2t"]).tolist() == list(range(0, 2 * DRAFT, 2))  # target = i + d2t[i]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "rms_norm_eps", "rope_theta", "max_position_embeddings"):  # fmt: skip
        assert key in config, key
    assert config["vocab_size"] == VOCAB and config["draft_vocab_size"] == DRAFT
    assert config["target_hidden_size"] == HIDDEN and config["num_hidden_layers"] == 1
    assert config["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}


def test_round_trip_gives_identical_draft_logits(exported, target):
    drafter, out = exported
    loaded = load_drafter(out, target)
    aux, embeds = torch.randn(2, 6, 3 * HIDDEN), torch.randn(2, 6, HIDDEN)
    positions = torch.arange(6)[None].expand(2, -1)
    with torch.no_grad():
        expected = drafter.logits(drafter(drafter.fuse(aux), embeds, positions))
        got = loaded.logits(loaded(loaded.fuse(aux), embeds, positions))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(loaded.token_ids, drafter.token_ids)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_first_draft_step_from_the_exported_tensors_alone(exported, target):
    """One position: attention over a single key is that key's value, so the layer is plain matrix algebra."""
    drafter, out = exported
    t = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    eps, heads, kv = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    aux, emb = torch.randn(3 * HIDDEN), torch.randn(HIDDEN)
    feature = t["fc.weight"] @ aux
    x = torch.cat(
        [rms(emb, t["midlayer.input_layernorm.weight"], eps), rms(feature, t["midlayer.hidden_norm.weight"], eps)]
    )
    v = t["midlayer.self_attn.v_proj.weight"] @ x  # [kv * d]
    v = v.view(kv, -1).repeat_interleave(heads // kv, dim=0).flatten()  # each query head reads its kv head's value
    hidden = feature + t["midlayer.self_attn.o_proj.weight"] @ v
    normed = rms(hidden, t["midlayer.post_attention_layernorm.weight"], eps)
    mlp = t["midlayer.mlp.down_proj.weight"] @ (
        F.silu(t["midlayer.mlp.gate_proj.weight"] @ normed) * (t["midlayer.mlp.up_proj.weight"] @ normed)
    )
    logits = t["lm_head.weight"] @ rms(hidden + mlp, t["norm.weight"], eps)
    token = int(logits.argmax()) + int(t["d2t"][logits.argmax()])
    with torch.no_grad():
        state = drafter(drafter.fuse(aux.view(1, 1, -1)), emb.view(1, 1, -1), torch.zeros(1, 1, dtype=torch.long))
        framework = drafter.logits(state)[0, 0]
    torch.testing.assert_close(framework, logits, atol=1e-5, rtol=1e-5)
    assert drafter.token_ids[framework.argmax()] == token


def rewrite(out, edit):
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")


def test_broken_files_and_other_targets_are_refused(exported, target):
    _, out = exported
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[:-64])
    with pytest.raises(FormatError, match="not a readable safetensors file"):
        load_drafter(out, target)
    (out / "model.safetensors").write_bytes(data)
    rewrite(out, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(FormatError, match="no lm_head.weight"):
        load_drafter(out, target)
    (out / "model.safetensors").write_bytes(data)
    rewrite(out, lambda t: t["t2d"].__setitem__(2, False))
    with pytest.raises(FormatError, match="d2t and t2d disagree"):
        load_drafter(out, target)
    (out / "model.safetensors").write_bytes(data)
    rewrite(out, lambda t: t.update({"embed_tokens.weight": torch.randn(VOCAB, HIDDEN)}))
    with pytest.raises(FormatError, match="not the target's input embedding"):
        load_drafter(out, target)
    (out / "model.safetensors").write_bytes(data)
    with pytest.raises(DrafterMismatchError, match="hidden size"):
        load_drafter(out, tiny_target("llama", hidden_size=48, head_dim=12))
    with pytest.raises(DrafterMismatchError, match="vocabulary size"):
        load_drafter(out, tiny_target("llama", vocab_size=VOCAB + 3))
    config = json.loads((out / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 5, 9]
    config.pop("medusa_like")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="outside the target's 8 layers"):
        load_drafter(out, target)


def test_an_engine_config_without_our_section_loads(exported, target):
    drafter, out = exported
    config = json.loads((out / "config.json").read_text())
    config.pop("medusa_like")  # as a drafter trained elsewhere (SpecForge, EAGLE's authors) ships
    (out / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(out, target)
    aux, embeds = torch.randn(1, 4, 3 * HIDDEN), torch.randn(1, 4, HIDDEN)
    with torch.no_grad():
        expected = drafter.logits(drafter(drafter.fuse(aux), embeds, torch.arange(4)[None]))
        got = loaded.logits(loaded(loaded.fuse(aux), embeds, torch.arange(4)[None]))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_a_non_llama_layer_is_refused_for_the_engines(tmp_path):
    gemma = tiny_target("gemma3")
    drafter = Eagle3Drafter(Eagle3Config.for_target(gemma.config, DRAFT), DraftVocab(torch.arange(DRAFT), VOCAB))
    with pytest.raises(FormatError, match="gemma3_text layer.*format=native keeps it usable"):
        export_drafter(drafter, tmp_path / "x", "eagle3", gemma, "tiny/gemma")
    assert not (tmp_path / "x").exists()


def test_sglang_names_layer_outputs(target, tmp_path):
    big = tiny_target("llama", num_hidden_layers=8)
    drafter = drafter_for(big)
    vllm = export_drafter(drafter, tmp_path / "v", "eagle3", big, "t")
    sglang = export_drafter(drafter, tmp_path / "s", "eagle3_sglang", big, "t")
    ids = [
        json.loads((d / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        for d in (vllm, sglang)
    ]
    assert ids == [[2, 4, 5], [1, 3, 4]]  # vLLM: the stream entering layer i; SGLang: the output of layer i
    assert load_file(vllm / "model.safetensors").keys() == load_file(sglang / "model.safetensors").keys()


def test_a_full_draft_vocabulary_is_written_without_maps_as_vllm_loads_it(target, tmp_path):
    """vLLM builds no draft_id_to_target_id when the draft vocabulary is the target's whole vocabulary, and refuses a
    d2t then: the vLLM export leaves both maps out, and reads back as the identity."""
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, VOCAB), DraftVocab.full(VOCAB)).eval()
    out = export_drafter(drafter, tmp_path / "vllm", "eagle3", target, "tiny/llama")
    assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    loaded = load_drafter(out, target)
    assert torch.equal(loaded.vocab.token_ids, torch.arange(VOCAB))
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_partial_draft_vocabulary_without_its_maps_is_refused(exported, target):
    _, out = exported
    rewrite(out, lambda t: (t.pop("d2t"), t.pop("t2d")))
    with pytest.raises(FormatError, match="no d2t"):
        load_drafter(out, target)


def test_aux_layers_vllm_would_reorder_are_refused_for_vllm(tmp_path):
    """vLLM captures each aux layer once, in layer order: a drafter reading [2, 2, 1] would get other features."""
    target = tiny_target("llama", num_hidden_layers=4)
    config = Eagle3Config.for_target(target.config, DRAFT)
    drafter = Eagle3Drafter(
        Eagle3Config(**{**config.__dict__, "aux_layer_ids": (2, 2, 1)}), DraftVocab(torch.arange(DRAFT), VOCAB)
    )
    with pytest.raises(FormatError, match="layer order"):
        export_drafter(drafter, tmp_path / "vllm", "eagle3", target, "tiny/llama")
    export_drafter(drafter, tmp_path / "native", "native", target, "tiny/llama")  # usable here
