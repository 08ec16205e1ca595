"""`format=gguf`: the EAGLE-3 drafter as llama.cpp's `eagle3` GGUF.

The layout is checked against a spec written here from llama.cpp's own source (src/models/eagle3.cpp: the tensors
and their shapes, innermost dimension first; src/llama-arch.cpp: the key names; conversion/llama.py: the q/k
permutation, d2t as absolute ids), not against the exporter. The forward below is llama.cpp's eagle3 decoder graph
written again in torch from the file's tensors alone, with llama.cpp's RoPE (adjacent pairs); it must give the
framework's first draft step. Where llama.cpp is built (`make llamacpp-build`), llama.cpp itself drafts with the
export and decodes its plain decoding's text; elsewhere that test skips, saying so.
"""

import importlib.util
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf import GGUFWriter

from medusa_like.decoding.tree_files import resolve_tree
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.drafters.eagle3_proposer import Eagle3Proposer
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.formats import export_drafter
from medusa_like.formats.common import FormatError
from medusa_like.formats.gguf import GGUF_FILE, read_gguf, read_gguf_file

from .conftest import tiny_target

DRAFT_VOCAB = 40
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0
MATRIX_TYPES = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0}


def tokenizer_gguf(path, vocab_size: int, arch: str = "llama"):
    """A stand-in for the target's own GGUF: only the keys the drafter's file copies (its tokenizer)."""
    writer = GGUFWriter(path, arch)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(vocab_size)])
    writer.add_key_value("tokenizer.ggml.token_type", [1] * vocab_size, V.ARRAY, V.INT32)
    writer.add_array("tokenizer.ggml.merges", ["t o", "to k"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_drafter(target, seed: int = 0, aux=None) -> Eagle3Drafter:
    """Every parameter random (norms around 1, so swapped norms show), over a scattered draft vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    vocab_size = target.config.vocab_size
    ids = torch.randperm(vocab_size, generator=gen)[:DRAFT_VOCAB].sort().values
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, DRAFT_VOCAB, aux), DraftVocab(ids, vocab_size))
    with torch.no_grad():
        for p in drafter.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if p.dim() == 1 else noise * 0.3)
    return drafter.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def drafter(target):
    return random_drafter(target)


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory, target):
    return tokenizer_gguf(tmp_path_factory.mktemp("target") / "target.gguf", target.config.vocab_size)


def export(drafter, target, target_gguf, out, dtype=None):
    return read_gguf(export_drafter(drafter, out, "gguf", target, str(target_gguf), dtype=dtype) / GGUF_FILE)


def spec_tensors(config, precision: str) -> dict:
    """name -> (GGUF shape, innermost first, as create_tensor lists it in src/models/eagle3.cpp; type)."""
    h, h_t, inter = config.hidden_size, config.hidden_size, config.intermediate_size  # as wide as its target
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    m = MATRIX_TYPES[precision]
    return {
        "fc.weight": ((3 * h_t, h), m),
        "output_norm.weight": ((h,), Q.F32),
        "output.weight": ((h, DRAFT_VOCAB), m),
        "blk.0.attn_norm.weight": ((h,), Q.F32),
        "blk.0.attn_norm_2.weight": ((h,), Q.F32),
        "blk.0.attn_q.weight": ((2 * h, heads * d), m),
        "blk.0.attn_k.weight": ((2 * h, kv * d), m),
        "blk.0.attn_v.weight": ((2 * h, kv * d), m),
        "blk.0.attn_output.weight": ((heads * d, h), m),
        "blk.0.ffn_norm.weight": ((h,), Q.F32),
        "blk.0.ffn_gate.weight": ((h, inter), m),
        "blk.0.ffn_up.weight": ((h, inter), m),
        "blk.0.ffn_down.weight": ((inter, h), m),
        "d2t": ((DRAFT_VOCAB,), Q.I64),
    }


def spec_keys(config, aux, precision: str) -> dict:
    """key -> (GGUF value type, value): the eagle3 keys llama.cpp's loader reads."""
    return {
        "general.architecture": (V.STRING, "eagle3"),
        "general.name": (V.STRING, "EAGLE-3 drafter for tiny_llama"),
        "general.file_type": (V.UINT32, FILE_TYPES[precision]),
        "general.quantization_version": (V.UINT32, 2),
        "eagle3.context_length": (V.UINT32, config.max_position_embeddings),
        "eagle3.embedding_length": (V.UINT32, config.hidden_size),
        "eagle3.block_count": (V.UINT32, 1),
        "eagle3.feed_forward_length": (V.UINT32, config.intermediate_size),
        "eagle3.attention.head_count": (V.UINT32, config.num_attention_heads),
        "eagle3.attention.head_count_kv": (V.UINT32, config.num_key_value_heads),
        "eagle3.attention.key_length": (V.UINT32, config.head_dim),
        "eagle3.attention.value_length": (V.UINT32, config.head_dim),
        "eagle3.attention.layer_norm_rms_epsilon": (V.FLOAT32, config.rms_norm_eps),
        "eagle3.rope.freq_base": (V.FLOAT32, config.rope_parameters["rope_theta"]),
        "eagle3.rope.dimension_count": (V.UINT32, config.head_dim),
        "eagle3.vocab_size": (V.UINT32, config.vocab_size),
        "eagle3.target_layers": (V.INT32, list(aux)),  # an array of int32
        "eagle3.target_hidden_size": (V.UINT32, config.hidden_size),
        "eagle3.norm_before_residual": (V.BOOL, False),
        "eagle3.norm_before_fc": (V.BOOL, False),
    }


@pytest.mark.parametrize("precision", ["f32", "f16", "q8_0"])
def test_layout_matches_llamacpp_spec(tmp_path, target, drafter, target_gguf, precision):
    gguf = export(drafter, target, target_gguf, tmp_path / "out", dtype=precision)
    config = target.config
    tensors = spec_tensors(config, precision)
    assert set(gguf.tensors) == set(tensors)  # no t2d, no token_embd
    for name, (shape, kind) in tensors.items():
        t = gguf.tensors[name]
        assert (tuple(int(n) for n in t.shape), t.tensor_type) == (shape, kind), name
    assert gguf.array("d2t").tolist() == drafter.token_ids.tolist()  # absolute target ids, not offsets

    source = read_gguf_file(target_gguf)
    tokenizer = {k: f for k, f in source.fields.items() if k.startswith("tokenizer.")}
    keys = spec_keys(config, drafter.config.aux_layer_ids, precision)
    written = {k for k in gguf.fields if not k.startswith("GGUF.")}
    assert written == set(keys) | set(tokenizer)
    for key, (kind, value) in keys.items():
        field = gguf.fields[key]
        assert field.types[-1] == kind, key
        got = field.contents()
        assert got == pytest.approx(value) if kind == V.FLOAT32 else got == value, key
    for key, field in tokenizer.items():
        assert (gguf.fields[key].types, gguf.fields[key].contents()) == (field.types, field.contents()), key


def unpermute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's converter permutation: rows back to transformers' half-split RoPE order."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def test_q_k_permutation_undone_gives_the_drafters_projections(tmp_path, target, drafter, target_gguf):
    gguf = export(drafter, target, target_gguf, tmp_path / "out")
    heads, kv = target.config.num_attention_heads, target.config.num_key_value_heads
    q, k = gguf.array("blk.0.attn_q.weight"), gguf.array("blk.0.attn_k.weight")
    assert not np.allclose(q, drafter.self_attn.q_proj.weight.detach().numpy())  # it is permuted
    np.testing.assert_array_equal(unpermute(q, heads), drafter.self_attn.q_proj.weight.detach().numpy())
    np.testing.assert_array_equal(unpermute(k, kv), drafter.self_attn.k_proj.weight.detach().numpy())


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_adjacent(x, positions, base):
    """llama.cpp's LLAMA_ROPE_TYPE_NORM: rotates the pairs (2i, 2i + 1) of each head. x [T, H, d]."""
    d = x.shape[-1]
    angle = positions[:, None].double() * base ** (-torch.arange(0, d, 2).double() / d)  # [T, d/2]
    cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]  # [T, 1, d/2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def gguf_forward(gguf, embeddings, features, tokens):
    """llama.cpp's eagle3 encoder + decoder graph from the file's tensors: features [T, 3 h_t] of positions 0..T-1,
    tokens [T] (the token after each position) -> full-vocabulary logits [T, V] (-inf outside the draft vocabulary)."""
    w = {name: torch.from_numpy(gguf.array(name)) for name in gguf.tensors}
    eps = gguf.value("eagle3.attention.layer_norm_rms_epsilon")
    heads, kv = gguf.value("eagle3.attention.head_count"), gguf.value("eagle3.attention.head_count_kv")
    d, base = gguf.value("eagle3.attention.key_length"), gguf.value("eagle3.rope.freq_base")
    n = tokens.numel()
    g = features @ w["fc.weight"].T  # [T, h]: the encoder's output
    x = torch.cat(
        [rms(embeddings[tokens], w["blk.0.attn_norm.weight"], eps), rms(g, w["blk.0.attn_norm_2.weight"], eps)], -1
    )
    positions = torch.arange(n)
    q = rope_adjacent((x @ w["blk.0.attn_q.weight"].T).view(n, heads, d), positions, base)
    k = rope_adjacent((x @ w["blk.0.attn_k.weight"].T).view(n, kv, d), positions, base)
    v = (x @ w["blk.0.attn_v.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)  # [T, heads, d]
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, heads * d) @ w["blk.0.attn_output.weight"].T
    hidden = g + attn  # norm_before_residual = false: the raw fused feature is the residual
    m = rms(hidden, w["blk.0.ffn_norm.weight"], eps)
    gated = torch.nn.functional.silu(m @ w["blk.0.ffn_gate.weight"].T) * (m @ w["blk.0.ffn_up.weight"].T)  # [T, I]
    state = hidden + gated @ w["blk.0.ffn_down.weight"].T
    draft = rms(state, w["output_norm.weight"], eps) @ w["output.weight"].T  # [T, N]
    logits = torch.full((n, embeddings.shape[0]), float("-inf"))
    logits[:, w["d2t"]] = draft  # d2t holds absolute target ids
    return logits


@pytest.mark.parametrize("prompt_length", [1, 5])  # 1: attention over one key; 5: RoPE and q/k order matter
def test_gguf_forward_equals_first_draft_step(tmp_path, target, drafter, target_gguf, prompt_length):
    gguf = export(drafter, target, target_gguf, tmp_path / "out")
    prompt = torch.randint(0, target.config.vocab_size, (prompt_length,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = target(prompt[None], output_hidden_states=True)
    root = out.logits[0, -1].argmax().view(1)
    # llama.cpp captures the *input* of each target layer in eagle3.target_layers: transformers' hidden_states[i]
    features = torch.cat([out.hidden_states[i][0] for i in gguf.value("eagle3.target_layers")], dim=-1)
    tokens = torch.cat([prompt[1:], root])
    embeddings = target.get_input_embeddings().weight.detach()
    logits = gguf_forward(gguf, embeddings, features, tokens)[-1]  # [V]

    proposer = Eagle3Proposer(drafter, target)
    ours = torch.cat([out.hidden_states[i][0] for i in proposer.feature_layers], dim=-1)
    proposer.begin(prompt, ours, root, capacity=prompt_length + 8)
    with torch.no_grad():
        tree = proposer.propose(resolve_tree([[0]]))
        state = drafter(drafter.fuse(ours)[None], embeddings[tokens][None], torch.arange(prompt_length)[None])
        expected = drafter.logits(state[0, -1])
    torch.testing.assert_close(logits[drafter.token_ids], expected, atol=1e-4, rtol=1e-4)
    assert int(logits.argmax()) == int(tree.tokens[1])
    torch.testing.assert_close(logits.log_softmax(-1).max(), tree.logp[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("precision, tolerance", [("f16", 1e-3), ("q8_0", 1.0 / 127)])
def test_reduced_precisions_stay_within_their_rounding(tmp_path, target, drafter, target_gguf, precision, tolerance):
    """Every matrix of an f16 / q8_0 file is the drafter's within the format's rounding (q8_0: one step of a
    32-value block's scale, amax / 127)."""
    exact = export(drafter, target, target_gguf, tmp_path / "f32")
    reduced = export(drafter, target, target_gguf, tmp_path / precision, dtype=precision)
    for name, tensor in exact.tensors.items():
        if tensor.tensor_type == Q.I64 or len(tensor.shape) == 1:
            continue
        a, b = exact.array(name), reduced.array(name)
        scale = np.abs(a).reshape(-1, 32).max(-1, keepdims=True) if precision == "q8_0" else np.abs(a).reshape(-1, 1)
        assert np.all(np.abs(a - b).reshape(scale.shape[0], -1) <= tolerance * scale + 1e-7), name
        assert not np.array_equal(a, b), name  # really stored at the reduced precision


# ---------------------------------------------------------------------------------------------------------------------
# Errors and refusals


def test_truncated_file_is_refused_naming_it(tmp_path, target, drafter, target_gguf):
    out = export_drafter(drafter, tmp_path / "out", "gguf", target, str(target_gguf))
    file = out / GGUF_FILE
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(FormatError, match=f"{file}.*truncated"):
        read_gguf(file)
    file.write_bytes(data[:20])
    with pytest.raises(FormatError, match=str(file)):
        read_gguf(file)


def test_wrong_arch_is_refused(target_gguf):
    with pytest.raises(FormatError, match=f"{target_gguf}.*'llama'.*'eagle3'"):
        read_gguf(target_gguf)


def test_missing_keys_are_named(tmp_path, target, drafter, target_gguf):
    gguf = export(drafter, target, target_gguf, tmp_path / "out")
    path = tmp_path / "without_layers.gguf"
    writer = GGUFWriter(path, "eagle3")
    for key, field in gguf.fields.items():
        if key.startswith("GGUF.") or key == "eagle3.target_layers":
            continue
        writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for name, tensor in gguf.tensors.items():
        writer.add_tensor(name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "eagle3.target_layers" not in read_gguf_file(path).fields
    with pytest.raises(FormatError, match=f"{path} lacks the metadata keys \\['eagle3.target_layers'\\]"):
        read_gguf(path)


def test_refuses_what_llamacpp_cannot_run(tmp_path, target, target_gguf):
    two_aux = random_drafter(target, aux=(0, 1))
    with pytest.raises(FormatError, match="2 aux layers.*exactly 3"):
        export_drafter(two_aux, tmp_path / "a", "gguf", target, str(target_gguf))
    last = random_drafter(target, aux=(0, 1, 2))  # 2 = L: the target's normed last state in transformers
    with pytest.raises(FormatError, match="aux layer 2 is the target's last state"):
        export_drafter(last, tmp_path / "b", "gguf", target, str(target_gguf))
    qwen = tiny_target("qwen2")
    with pytest.raises(FormatError, match="qwen2 layer"):
        export_drafter(random_drafter(qwen), tmp_path / "c", "gguf", qwen, str(target_gguf))
    assert not any((tmp_path / name).exists() for name in "abc")


def test_refuses_a_tokenizer_that_is_not_the_targets(tmp_path, target, drafter):
    other = tokenizer_gguf(tmp_path / "other.gguf", target.config.vocab_size + 3)
    with pytest.raises(FormatError, match=f"{other} has {target.config.vocab_size + 3} tokens"):
        export_drafter(drafter, tmp_path / "a", "gguf", target, str(other))
    with pytest.raises(FormatError, match="target's own GGUF"):
        export_drafter(drafter, tmp_path / "b", "gguf", target, "HuggingFaceTB/SmolLM2-135M-Instruct-not-a-gguf")
    with pytest.raises(ValueError, match="f32, f16 or q8_0, not 'bfloat16'"):
        export_drafter(drafter, tmp_path / "c", "gguf", target, str(tmp_path / "other.gguf"), dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------------
# llama.cpp itself, where `make llamacpp-build` built it: our export drafting for it

LLAMACPP = Path(__file__).resolve().parents[1] / ".llamacpp"


def llamacpp_missing() -> str | None:
    """Why llama.cpp cannot run our export here (one line), or None."""
    from medusa_like.engines.llamacpp import plain
    from medusa_like.engines.llamacpp.runner import executable

    if not executable(LLAMACPP).is_file():
        return f"llama.cpp is not built here ({LLAMACPP}); `make llamacpp-build` builds it"
    if plain.converter(LLAMACPP) is None or importlib.util.find_spec("sentencepiece") is None:
        return "llama.cpp's converter or its sentencepiece is missing; `make llamacpp-build` installs them"
    return None


@pytest.mark.slow
@pytest.mark.skipif(llamacpp_missing() is not None, reason=f"{llamacpp_missing()}")
def test_llamacpp_drafts_with_our_gguf_export_and_decodes_plain_decodings_tokens(tmp_path):
    """`llama-speculative-simple --spec-type draft-eagle3` with our GGUF export of an EAGLE-3 drafter, on a tiny target
    converted by llama.cpp's own converter: the text of its plain decoding, and drafts accepted.

    A random drafter is never accepted (nor in our own loop), so the target is made one whose next token is known: every
    token embeds alike and no layer adds to the residual, so it says one token c after any prompt (logits x20: no
    near-tie between llama.cpp's single-token and batched arithmetic). The drafter started from the target's last
    layer and head says c too, over a draft vocabulary where c's index is not c: llama.cpp accepts its drafts only if
    it reads the file's graph, head and d2t as we wrote them (the features' layers are
    `test_gguf_forward_equals_first_draft_step`'s)."""
    from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from medusa_like.drafters.vocab import DraftVocab
    from medusa_like.engines.llamacpp import plain
    from medusa_like.engines.llamacpp.runner import PLAIN, Setting, executable, parse_output, prompt_command
    from medusa_like.tiny import tiny_chat_target

    target, tokenizer = tiny_chat_target(num_layers=2, seed=3, tie_word_embeddings=False)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(20)
        embeddings = target.get_input_embeddings().weight
        embeddings.copy_(embeddings[0].expand_as(embeddings).clone())
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        said = int(target(torch.tensor([[1, 2, 3]])).logits[0, -1].argmax())
    (tmp_path / "src").symlink_to(LLAMACPP / "src")  # the converter's sources; the converted file stays here
    target_file = plain.target_file(target, tokenizer, tmp_path)
    vocab = target.config.vocab_size
    ids = sorted({*range(1, vocab, 2), said})  # odd ids and c: c's draft index is not c
    assert ids.index(said) != said
    config = Eagle3Config.for_target(target.config, len(ids), None)
    drafter = Eagle3Drafter(config, DraftVocab(torch.tensor(ids), vocab))
    drafter.init_layer_from_target(target, target.config.num_hidden_layers - 1)
    drafter.init_from_target(target)
    drafter_file = export_drafter(drafter, tmp_path / "gguf", "gguf", target, str(target_file)) / GGUF_FILE

    def run(setting) -> tuple[str, dict]:
        command = prompt_command(executable(LLAMACPP), target_file, "Write a haiku about rain.", setting, 1, 32, 512)
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=600)
        assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
        return done.stdout, parse_output(done.stdout + done.stderr)

    plain_text, plain_figures = run(PLAIN)
    text, figures = run(Setting("eagle3 d3", "draft-eagle3", drafter_file, 3))
    # speculative-simple adds a step's accepted drafts whole, so it may run up to a draft's length past -n
    assert text.startswith(plain_text.rstrip("\n")) and plain_figures["drafted"] == 0
    assert plain_figures["tokens"] <= figures["tokens"] <= plain_figures["tokens"] + 3, (plain_figures, figures)
    assert figures["drafted"] > 0 and figures["accepted"] > 0, figures
