"""The EAGLE-3 drafter as one GGUF file for llama.cpp (`format=gguf`), written with gguf-py, and a strict reader.

llama.cpp (PR #18039; read in the llama.cpp that `llama-cpp-python` 0.3.36 vendors) runs an EAGLE-3 drafter as the
GGUF architecture `eagle3`: `llama-speculative-simple --spec-type draft-eagle3 -md drafter.gguf`. What it loads
(`src/models/eagle3.cpp`, `src/llama-arch.cpp`, the Llama converter in `conversion/llama.py`):

    general.architecture = "eagle3"
    eagle3.{context_length, embedding_length, block_count = 1, feed_forward_length, attention.head_count,
            attention.head_count_kv, attention.key_length, attention.value_length, attention.layer_norm_rms_epsilon,
            rope.freq_base, rope.dimension_count, vocab_size}
    eagle3.target_layers          [3] int32   layer ids whose *input* it captures (= transformers' hidden_states[i])
    eagle3.target_hidden_size     uint32
    eagle3.norm_before_residual   false       our layer adds the raw fused feature back, as llama.cpp's default does
    eagle3.norm_before_fc         false       no norm before fc
    tokenizer.*                   copied from the target's own GGUF (llama.cpp checks draft and target vocabularies)

    fc.weight [3 h_t, h]   output_norm.weight [h]   output.weight [h, N]   d2t [N] int64 (absolute target ids)
    blk.0.{attn_norm, attn_norm_2 (our hidden_norm), ffn_norm}.weight [h]
    blk.0.attn_{q,k,v}.weight [2h, heads * d]   blk.0.attn_output.weight [heads * d, h]
    blk.0.ffn_{gate,up}.weight [h, I]   blk.0.ffn_down.weight [I, h]

Shapes are GGUF's (innermost first, the reverse of torch's). q and k are permuted as llama.cpp's Llama converter does:
its RoPE rotates adjacent pairs, transformers' rotates the two halves of each head. No `t2d` and no `token_embd` (the
target's embeddings are used). Matrices are written in f32, f16 or q8_0; norms stay f32 (a q8_0 matrix whose rows are
not a multiple of 32 falls back to f16, as the converter does).

Refused, with the reason: layers that are not Llama's (llama.cpp's eagle3 graph is a Llama layer, and its other
target graphs do not all expose their layer inputs), other than 3 aux layers, an aux layer L (llama.cpp feeds the
pre-norm last state, transformers' hidden_states[L] is normed), RoPE scaling.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, quants

from medusa_like.drafters.base import check_fits
from medusa_like.drafters.eagle3 import Eagle3Drafter
from medusa_like.formats.common import FormatError, write_export
from medusa_like.formats.llama_layer import llama_refusal
from medusa_like.targets import DEFAULT_TARGET, DEFAULT_TARGET_ALIASES, cache_dir, default_target_gguf

ARCH = "eagle3"
GGUF_FILE = "drafter.gguf"
PRECISIONS = {  # export dtype -> (matrix type, general.file_type)
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
_PRECISION_NAMES = {"float32": "f32", "float16": "f16", "f32": "f32", "f16": "f16", "q8_0": "q8_0"}
_TARGET_ARCHS = ("llama",)  # target graphs whose layer inputs llama.cpp captures and whose layer our drafter copies

# our state_dict name -> GGUF tensor name
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "blk.0.attn_norm.weight",
    "hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "mlp.down_proj.weight": "blk.0.ffn_down.weight",
}
REQUIRED_KEYS = (
    "general.architecture",
    "eagle3.context_length",
    "eagle3.embedding_length",
    "eagle3.block_count",
    "eagle3.feed_forward_length",
    "eagle3.attention.head_count",
    "eagle3.attention.head_count_kv",
    "eagle3.attention.layer_norm_rms_epsilon",
    "eagle3.target_layers",
    "eagle3.target_hidden_size",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
)
REQUIRED_TENSORS = (*TENSOR_NAMES.values(), "d2t")


def permute_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """q/k rows [n_head * d, in] from transformers' half-split RoPE order to llama.cpp's adjacent-pair order (the
    converter's `LlamaModel.permute`)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_precision(dtype) -> str:
    """The export `dtype` (None, a torch dtype or a name) as one of PRECISIONS; None writes f32."""
    if dtype is None:
        return "f32"
    name = str(dtype).removeprefix("torch.")
    if name not in _PRECISION_NAMES:
        raise ValueError(f"format=gguf writes dtype f32, f16 or q8_0, not {name!r}")
    return _PRECISION_NAMES[name]


def gguf_refusal(drafter: Eagle3Drafter, target) -> str | None:
    """Why llama.cpp's eagle3 model cannot run this drafter for `target`, or None when it can."""
    layer, config = drafter.config.layer, drafter.config
    if layer.get("model_type") != "llama":
        return (
            f"its layer is a {layer.get('model_type')} layer: llama.cpp's eagle3 graph is a Llama layer, and it reads "
            "target features only from targets whose graph exposes layer inputs (llama among the dense families)"
        )
    if reason := llama_refusal(drafter):
        return reason
    if len(config.aux_layer_ids) != 3:
        return (
            f"it fuses {len(config.aux_layer_ids)} aux layers {list(config.aux_layer_ids)}; llama.cpp needs exactly 3"
        )
    n_layers = target.config.get_text_config().num_hidden_layers
    if n_layers in config.aux_layer_ids:
        return (
            f"aux layer {n_layers} is the target's last state: llama.cpp feeds it before the final norm, "
            "transformers' hidden_states[L] after it"
        )
    rope = layer.get("rope_parameters") or {}
    if layer.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        return f"its RoPE is scaled ({layer.get('rope_scaling') or rope}); this export writes plain RoPE only"
    return None


def target_gguf(target_name: str) -> Path:
    """The target's own GGUF, whose tokenizer the drafter's file copies: `target_name` itself when it is a .gguf file,
    the embedded default's for the default target (by alias or its converted directory)."""
    path = Path(target_name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF {path} does not exist")
        return path
    default_dir = cache_dir() / DEFAULT_TARGET
    if target_name in DEFAULT_TARGET_ALIASES or (path.exists() and path.resolve() == default_dir.resolve()):
        return default_target_gguf()
    raise FormatError(
        f"format=gguf copies the tokenizer from the target's own GGUF, and {target_name!r} is not one: pass the "
        "target's .gguf file as the target name (train.export: base_model=<path/to/target.gguf>)"
    )


def write_gguf(drafter: Eagle3Drafter, out_dir, target, target_name: str, dtype=None, overwrite=False) -> Path:
    """Write `drafter` as `out_dir/drafter.gguf` (one export unit, `common.write_export`); returns the directory."""
    check_fits(drafter.config.target_hidden_size, drafter.config.vocab_size, target, source="being exported")
    if reason := gguf_refusal(drafter, target):
        raise FormatError(f"cannot export this drafter as format=gguf for llama.cpp: {reason}")
    precision = gguf_precision(dtype)
    source = target_gguf(target_name)
    tokenizer = _tokenizer_fields(source, target)
    files = {GGUF_FILE: lambda path: _write_file(drafter, path, target, tokenizer, precision)}
    return write_export(out_dir, files, {"drafter": "eagle3", "format": "gguf", "dtype": precision}, overwrite)


def _write_file(drafter: Eagle3Drafter, path: Path, target, tokenizer: list, precision: str) -> None:
    config, layer = drafter.config, drafter.config.layer
    n_head = int(layer["num_attention_heads"])
    n_kv = int(layer.get("num_key_value_heads") or n_head)
    head_dim = int(layer.get("head_dim") or config.hidden_size // n_head)
    rope_theta = layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    matrix_type, file_type = PRECISIONS[precision]
    writer = GGUFWriter(path, ARCH)
    writer.add_string("general.name", f"EAGLE-3 drafter for {target.config.name_or_path or 'its target'}")
    writer.add_uint32("general.file_type", int(file_type))
    writer.add_uint32("general.quantization_version", 2)  # GGML_QNT_VERSION
    writer.add_uint32(f"{ARCH}.context_length", int(layer.get("max_position_embeddings") or 4096))
    writer.add_uint32(f"{ARCH}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{ARCH}.block_count", 1)
    writer.add_uint32(f"{ARCH}.feed_forward_length", int(layer["intermediate_size"]))
    writer.add_uint32(f"{ARCH}.attention.head_count", n_head)
    writer.add_uint32(f"{ARCH}.attention.head_count_kv", n_kv)
    writer.add_uint32(f"{ARCH}.attention.key_length", head_dim)
    writer.add_uint32(f"{ARCH}.attention.value_length", head_dim)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(layer["rms_norm_eps"]))
    writer.add_float32(f"{ARCH}.rope.freq_base", float(rope_theta))
    writer.add_uint32(f"{ARCH}.rope.dimension_count", head_dim)
    writer.add_uint32(f"{ARCH}.vocab_size", config.vocab_size)
    writer.add_key_value(f"{ARCH}.target_layers", list(config.aux_layer_ids), GGUFValueType.ARRAY, GGUFValueType.INT32)
    writer.add_uint32(f"{ARCH}.target_hidden_size", config.target_hidden_size)
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)
    for key, value, types in tokenizer:
        writer.add_key_value(key, value, types[0], types[-1] if len(types) > 1 else None)

    state = drafter.state_dict()
    for ours, name in TENSOR_NAMES.items():
        weight = state[ours].detach().float().cpu()
        if ours == "self_attn.q_proj.weight":
            weight = permute_rope(weight, n_head)
        elif ours == "self_attn.k_proj.weight":
            weight = permute_rope(weight, n_kv)
        _add_tensor(writer, name, weight.numpy(), matrix_type)
    writer.add_tensor("d2t", drafter.token_ids.cpu().numpy().astype(np.int64), raw_dtype=GGMLQuantizationType.I64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tensor(writer: GGUFWriter, name: str, data: np.ndarray, matrix_type: GGMLQuantizationType) -> None:
    """1-D tensors as f32; matrices as `matrix_type`, q8_0 falling back to f16 for rows not a multiple of 32."""
    if data.ndim == 1 or matrix_type == GGMLQuantizationType.F32:
        writer.add_tensor(name, data.astype(np.float32))
    elif matrix_type == GGMLQuantizationType.Q8_0 and data.shape[-1] % 32 == 0:
        writer.add_tensor(name, quants.quantize(data, matrix_type), raw_dtype=matrix_type)
    else:
        writer.add_tensor(name, data.astype(np.float16))


def _tokenizer_fields(source: Path, target) -> list[tuple[str, object, list]]:
    """(key, value, types) of every `tokenizer.*` key of the target's GGUF, after checking it is the target's."""
    gguf = read_gguf_file(source)
    arch = gguf.value("general.architecture")
    if arch not in _TARGET_ARCHS:
        raise FormatError(
            f"{source} is a {arch!r} model; llama.cpp's EAGLE-3 path here supports targets {_TARGET_ARCHS}"
        )
    tokens = gguf.fields.get("tokenizer.ggml.tokens")
    vocab_size = target.config.get_text_config().vocab_size
    if tokens is None or len(tokens.data) != vocab_size:
        found = "no tokenizer" if tokens is None else f"{len(tokens.data)} tokens"
        raise FormatError(f"{source} has {found}, the target has {vocab_size}: it is not the target's GGUF")
    return [
        (key, field.contents(), list(field.types)) for key, field in gguf.fields.items() if key.startswith("tokenizer.")
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Reading back: strict, for the tests and for checking a file before llama.cpp gets it


@dataclass
class GGUFFile:
    path: Path
    fields: dict  # key -> gguf ReaderField
    tensors: dict  # name -> gguf ReaderTensor

    def value(self, key: str):
        return self.fields[key].contents() if key in self.fields else None

    def array(self, name: str) -> np.ndarray:
        """A tensor's values as float32 (or its integers), de-quantised, in numpy's order (the reverse of GGUF's)."""
        tensor = self.tensors[name]
        if tensor.tensor_type in (GGMLQuantizationType.I64, GGMLQuantizationType.I32):
            return np.array(tensor.data)
        return quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Any GGUF file, with a `FormatError` naming it when it is unreadable or truncated."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as err:
        raise FormatError(f"{path} is not a readable GGUF file (truncated or corrupted?): {err}") from err
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise FormatError(f"{path} is truncated: tensor {tensor.name} ends past the file's {size} bytes")
    return GGUFFile(path, dict(reader.fields), {t.name: t for t in reader.tensors})


def read_gguf(path: str | Path) -> GGUFFile:
    """An EAGLE-3 drafter GGUF, checked for its architecture, the keys and tensors llama.cpp requires."""
    gguf = read_gguf_file(path)
    arch = gguf.value("general.architecture")
    if arch != ARCH:
        raise FormatError(f"{gguf.path} has general.architecture {arch!r}, expected {ARCH!r} (an EAGLE-3 drafter)")
    missing = [key for key in REQUIRED_KEYS if key not in gguf.fields]
    if missing:
        raise FormatError(f"{gguf.path} lacks the metadata keys {missing} that llama.cpp's eagle3 loader requires")
    layers = gguf.value("eagle3.target_layers")
    if len(layers) != 3:
        raise FormatError(f"{gguf.path}: eagle3.target_layers is {layers}, llama.cpp requires exactly 3 entries")
    absent = [name for name in REQUIRED_TENSORS if name not in gguf.tensors]
    if absent:
        raise FormatError(f"{gguf.path} lacks the tensors {absent} of an EAGLE-3 drafter")
    return gguf
