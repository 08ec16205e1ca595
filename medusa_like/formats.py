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

import torch

from .heads import HeadsConfig

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
            for native, foreign in zip(native_block_names(k, layer), foreign_block_names(fmt, k, layer)):
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


def native_config(cfg: HeadsConfig, target_name: str, fingerprint: str) -> dict:
    return {
        "medusa_like_format": FORMAT_VERSION,
        "head_type": "medusa",
        **cfg.to_dict(),
        "target": target_name,
        "target_fingerprint": fingerprint,
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
