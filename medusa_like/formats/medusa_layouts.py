"""Tensor layouts and config.json contents of the four head formats, as pure functions (no file access).

Every format holds the same numbers under different names. Inside this package the heads are `MedusaHeads`, whose
parameter names are the native layout; the other three are what serving engines read (K heads, L residual blocks per
head, hidden size H, vocabulary V):

    native  model.safetensors            blocks.{k}.{l}.linear.weight [H, H], blocks.{k}.{l}.linear.bias [H],
                                         lm_heads.{k}.weight [V, H] (own projections only)
    medusa  medusa_lm_head.safetensors   {k}.{l}.linear.weight [H, H], {k}.{l}.linear.bias [H], {k}.{L}.weight [V, H]
    vllm    model.safetensors            blocks.{k}.layers.{l}.weight [H, H], blocks.{k}.layers.{l}.bias [H],
                                         lm_heads.{k}.weight [V, H], or only lm_heads.0.weight with original_lm_head
    tgi     medusa_lm_head.safetensors   {k}.0.linear.weight [H, H], {k}.0.linear.bias [H] (L == 1, shared lm_head)

A format is recognised from config.json: our marker, vLLM's model_type, or `medusa_num_heads` (the original Medusa
layout, or TGI's compact form when the file holds no projections).
"""

import re
from dataclasses import dataclass, field

import torch

from medusa_like.drafters.medusa import HeadsConfig
from medusa_like.formats.common import FormatError

NATIVE, MEDUSA, VLLM, TGI = "native", "medusa", "vllm", "tgi"
FORMATS = (NATIVE, MEDUSA, VLLM, TGI)
FORMAT_VERSION = 1  # value of "medusa_like_format" in a native config.json
WEIGHTS_FILE = {
    NATIVE: "model.safetensors",
    MEDUSA: "medusa_lm_head.safetensors",
    VLLM: "model.safetensors",  # vLLM's default loader reads every *.safetensors in the directory
    TGI: "medusa_lm_head.safetensors",  # the one name TGI opens
}

Spec = dict[str, tuple[int, ...]]  # tensor name -> shape
Tensors = dict[str, torch.Tensor]


class HeadsFormatError(FormatError):
    """A heads directory, file or checkpoint that does not hold what its config says."""


# ---- names ----


def native_block_names(k: int, layer: int) -> tuple[str, str]:
    return f"blocks.{k}.{layer}.linear.weight", f"blocks.{k}.{layer}.linear.bias"


def foreign_block_names(fmt: str, k: int, layer: int) -> tuple[str, str]:
    """(weight, bias) names of block `layer` of head `k` in a serving format."""
    if fmt in (MEDUSA, TGI):
        return f"{k}.{layer}.linear.weight", f"{k}.{layer}.linear.bias"
    if fmt == VLLM:
        return f"blocks.{k}.layers.{layer}.weight", f"blocks.{k}.layers.{layer}.bias"
    raise ValueError(f"no foreign block names for format {fmt!r}; expected one of {MEDUSA, VLLM, TGI}")


def projection_name(fmt: str, k: int, num_layers: int) -> str:
    """Name of head k's own vocabulary projection."""
    if fmt == MEDUSA:
        return f"{k}.{num_layers}.weight"
    if fmt in (NATIVE, VLLM):
        return f"lm_heads.{k}.weight"
    raise ValueError(f"format {fmt!r} stores no projections")


# ---- specs: the exact names and shapes a file must hold ----


def blocks_spec(fmt: str, num_heads: int, num_layers: int, hidden: int, bias: bool = True) -> Spec:
    spec = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            w, b = native_block_names(k, layer) if fmt == NATIVE else foreign_block_names(fmt, k, layer)
            spec[w] = (hidden, hidden)
            if bias:
                spec[b] = (hidden,)
    return spec


def native_spec(cfg: HeadsConfig) -> Spec:
    spec = blocks_spec(NATIVE, cfg.num_heads, cfg.num_layers, cfg.hidden_size)
    if not cfg.shared_lm_head:
        spec.update({projection_name(NATIVE, k, 0): (cfg.vocab_size, cfg.hidden_size) for k in range(cfg.num_heads)})
    return spec


def medusa_spec(num_heads: int, num_layers: int, hidden: int, vocab: int) -> Spec:
    spec = blocks_spec(MEDUSA, num_heads, num_layers, hidden)
    spec.update({projection_name(MEDUSA, k, num_layers): (vocab, hidden) for k in range(num_heads)})
    return spec


def vllm_spec(num_heads: int, num_layers: int, hidden: int, vocab: int, bias: bool, original_lm_head: bool) -> Spec:
    spec = blocks_spec(VLLM, num_heads, num_layers, hidden, bias)
    num_projections = 1 if original_lm_head else num_heads
    spec.update({projection_name(VLLM, k, num_layers): (vocab, hidden) for k in range(num_projections)})
    return spec


def tgi_spec(num_heads: int, hidden: int) -> Spec:
    return blocks_spec(TGI, num_heads, 1, hidden)


# ---- renaming between the native blocks and a serving format ----


def blocks_to(fmt: str, blocks: Tensors, num_heads: int, num_layers: int) -> Tensors:
    """Native block tensors -> the same tensors under `fmt`'s names."""
    out = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            for native, foreign in zip(native_block_names(k, layer), foreign_block_names(fmt, k, layer), strict=True):
                out[foreign] = blocks[native]
    return out


def blocks_from(fmt: str, tensors: Tensors, num_heads: int, num_layers: int, hidden: int) -> Tensors:
    """`fmt`'s block tensors -> native names. A missing bias (vLLM without medusa_fc_bias) becomes zeros, exactly."""
    out = {}
    for k in range(num_heads):
        for layer in range(num_layers):
            (nw, nb), (fw, fb) = native_block_names(k, layer), foreign_block_names(fmt, k, layer)
            out[nw] = tensors[fw]
            out[nb] = tensors[fb] if fb in tensors else torch.zeros(hidden, dtype=tensors[fw].dtype)
    return out


# ---- config.json contents ----


def native_config(cfg: HeadsConfig, target_name: str, fingerprint: str, weights: str | None = None) -> dict:
    return {
        "medusa_like_format": FORMAT_VERSION,
        "head_type": "medusa",
        **cfg.to_dict(),
        "target": target_name,
        "target_fingerprint": fingerprint,
        "target_weights": weights,
    }


def medusa_config(cfg: HeadsConfig, target_name: str) -> dict:
    return {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": target_name,
    }


def vllm_config(cfg: HeadsConfig, original_lm_head: bool) -> dict:
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "medusa_fc_bias": True,  # our blocks always have a bias
        "original_lm_head": original_lm_head,
    }


def tgi_config(cfg: HeadsConfig, target_name: str) -> dict:
    # TGI reads base_model_name_or_path to find the target when it is pointed at the heads directory
    return {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": 1, "base_model_name_or_path": target_name}


def tgi_refusal(cfg: HeadsConfig) -> str | None:
    """Why these heads cannot be written in TGI's compact form, or None when they can."""
    reasons = []
    if cfg.num_layers != 1:
        reasons.append(f"they have {cfg.num_layers} residual blocks per head (TGI's compact form reads exactly 1)")
    if not cfg.shared_lm_head:
        reasons.append("they have their own vocabulary projections (TGI's compact form reuses the target's lm_head)")
    return "; ".join(reasons) or None


# ---- recognising a format ----

_MEDUSA_PROJECTION = re.compile(r"^\d+\.(\d+)\.weight$")


def detect_format(config: dict, weight_keys: list[str] | None = None) -> str:
    """The format of a heads directory from its config.json (and, for medusa vs tgi, its tensor names).

    Returns "medusa_or_tgi" when the config alone cannot tell and `weight_keys` is None.
    """
    if "medusa_like_format" in config:
        return NATIVE
    if config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or []):
        return VLLM
    if "medusa_num_heads" in config:
        if weight_keys is None:
            return "medusa_or_tgi"
        has_projection = any(
            (m := _MEDUSA_PROJECTION.match(key)) and m.group(1) == str(config.get("medusa_num_layers"))
            for key in weight_keys
        )
        return MEDUSA if has_projection or config.get("medusa_num_layers") != 1 else TGI
    raise ValueError(
        "config.json matches no known heads format: expected 'medusa_like_format' (native), "
        "model_type 'medusa' (vLLM) or 'medusa_num_heads' (Medusa / TGI); "
        f"its keys are {sorted(config)}"
    )


# ---- strict checks of a file against its layout ----


def config_field(config: dict, key: str, kind: type, source, default=None):
    """config[key] checked to be of `kind` (bool is not an int here); `default` when absent, unless it is None."""
    if key not in config:
        if default is not None:
            return default
        raise HeadsFormatError(f"{source} lacks the field {key!r}")
    value = config[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise HeadsFormatError(f"{source}: field {key!r} is {value!r}, expected a {kind.__name__}")
    return value


def _show(names: list[str], limit: int = 6) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def check_names(tensors: dict, spec: Spec, source, layout: str) -> None:
    """Every tensor of `spec` present and nothing else, or an error naming the missing and unexpected ones."""
    missing = sorted(set(spec) - set(tensors))
    extra = sorted(set(tensors) - set(spec))
    if missing or extra:
        parts = ([f"missing tensors {_show(missing)}"] if missing else []) + (
            [f"unexpected tensors {_show(extra)}"] if extra else []
        )
        raise HeadsFormatError(f"{source} does not match {layout}: {'; '.join(parts)}")


def check_shapes(tensors: dict, spec: Spec, source, layout: str) -> None:
    for name, shape in spec.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise HeadsFormatError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} for {layout}"
            )
        if not tensor.is_floating_point():
            raise HeadsFormatError(f"{source}: tensor {name!r} has dtype {tensor.dtype}, expected a float type")


# ---- parsing a file into the native names ----


@dataclass
class Parsed:
    """What a heads file holds, under native names; its names and shapes already checked against its config."""

    config: HeadsConfig  # shared_lm_head: no per-head projections in the file
    blocks: Tensors
    projections: list[torch.Tensor] | None = None  # per-head projections, when the file has them
    stored_lm_head: torch.Tensor | None = None  # the target's lm_head, stored for shared heads (vLLM original_lm_head)
    meta: dict = field(default_factory=dict)


def _checked(tensors: Tensors, spec: Spec, file, layout: str) -> None:
    check_names(tensors, spec, file, layout)
    check_shapes(tensors, spec, file, layout)


def parse_native(config: dict, tensors: Tensors, file) -> Parsed:
    source = f"{file.parent / 'config.json'}"
    version = config_field(config, "medusa_like_format", int, source)
    if version != FORMAT_VERSION:
        raise HeadsFormatError(f"{source}: medusa_like_format {version} is not supported (expected {FORMAT_VERSION})")
    head_type = config_field(config, "head_type", str, source)
    if head_type != "medusa":
        raise HeadsFormatError(f"{source}: head_type {head_type!r} is not supported (expected 'medusa')")
    cfg = HeadsConfig(
        hidden_size=config_field(config, "hidden_size", int, source),
        vocab_size=config_field(config, "vocab_size", int, source),
        num_heads=config_field(config, "num_heads", int, source),
        num_layers=config_field(config, "num_layers", int, source),
        shared_lm_head=config_field(config, "shared_lm_head", bool, source),
    )
    fp = config_field(config, "target_fingerprint", str, source)
    layout = f"config.json (num_heads={cfg.num_heads}, num_layers={cfg.num_layers}, shared={cfg.shared_lm_head})"
    _checked(tensors, native_spec(cfg), file, layout)
    own = None
    if not cfg.shared_lm_head:
        own = [tensors[projection_name(NATIVE, k, 0)] for k in range(cfg.num_heads)]
    blocks = {name: t for name, t in tensors.items() if name.startswith("blocks.")}
    meta = {"format": NATIVE, "target": config.get("target"), "target_fingerprint": fp,
            "target_weights": config.get("target_weights")}  # fmt: skip
    return Parsed(cfg, blocks, own, meta=meta)


def _dim(tensors: Tensors, name: str, axis: int, default: int) -> int:
    tensor = tensors.get(name)
    return int(tensor.shape[axis]) if tensor is not None and tensor.dim() == 2 else default


def parse_medusa_or_tgi(config: dict, tensors: Tensors, file, target_vocab: int) -> Parsed:
    """The original Medusa layout, or TGI's compact one when the file holds no projections (vocabulary: the target's)."""
    source = f"{file.parent / 'config.json'}"
    num_heads = config_field(config, "medusa_num_heads", int, source)
    num_layers = config_field(config, "medusa_num_layers", int, source)
    fmt = detect_format(config, list(tensors))
    layout = (
        f"the {'TGI' if fmt == TGI else 'Medusa'} layout of config.json "
        f"(medusa_num_heads={num_heads}, medusa_num_layers={num_layers})"
    )
    hidden = _dim(tensors, "0.0.linear.weight", 1, -1)
    if fmt == TGI:
        _checked(tensors, tgi_spec(num_heads, hidden), file, layout)
        cfg = HeadsConfig(hidden, target_vocab, num_heads, 1, shared_lm_head=True)
        return Parsed(cfg, blocks_from(TGI, tensors, num_heads, 1, hidden), meta={"format": TGI})
    vocab = _dim(tensors, projection_name(MEDUSA, 0, num_layers), 0, -1)
    _checked(tensors, medusa_spec(num_heads, num_layers, hidden, vocab), file, layout)
    own = [tensors[projection_name(MEDUSA, k, num_layers)] for k in range(num_heads)]
    cfg = HeadsConfig(hidden, vocab, num_heads, num_layers, shared_lm_head=False)
    blocks = blocks_from(MEDUSA, tensors, num_heads, num_layers, hidden)
    return Parsed(cfg, blocks, own, meta={"format": MEDUSA, "target": config.get("base_model_name_or_path")})


def parse_vllm(config: dict, tensors: Tensors, file) -> Parsed:
    source = f"{file.parent / 'config.json'}"
    num_heads = config_field(config, "num_heads", int, source)
    num_layers = config_field(config, "num_hidden_layers", int, source)
    hidden = config_field(config, "hidden_size", int, source)
    vocab = config_field(config, "vocab_size", int, source)
    bias = config_field(config, "medusa_fc_bias", bool, source, default=False)
    original = config_field(config, "original_lm_head", bool, source, default=False)
    truncated = config.get("truncated_vocab_size")
    if truncated not in (None, vocab):
        raise HeadsFormatError(f"{source}: truncated_vocab_size {truncated} != vocab_size {vocab} is not supported")
    tensors = {name.removeprefix("medusa_heads."): t for name, t in tensors.items()}
    layout = (
        f"the vLLM layout of config.json (num_heads={num_heads}, num_hidden_layers={num_layers}, "
        f"medusa_fc_bias={bias}, original_lm_head={original})"
    )
    _checked(tensors, vllm_spec(num_heads, num_layers, hidden, vocab, bias, original), file, layout)
    projections = [tensors[projection_name(VLLM, k, num_layers)] for k in range(1 if original else num_heads)]
    cfg = HeadsConfig(hidden, vocab, num_heads, num_layers, shared_lm_head=original)
    blocks = blocks_from(VLLM, tensors, num_heads, num_layers, hidden)
    if original:
        return Parsed(cfg, blocks, stored_lm_head=projections[0], meta={"format": VLLM})
    return Parsed(cfg, blocks, projections, meta={"format": VLLM})
