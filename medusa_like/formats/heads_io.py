"""Exact export and import of draft heads: our native directory, the original Medusa layout, vLLM and TGI.

    export_heads(heads, "out/vllm", "vllm", target_model=target, target_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    heads, meta = read_heads("out/vllm", target)                             # any of the four, detected from config
    heads, meta = heads_from_checkpoint(checkpoint, path)                    # a loaded training checkpoint

Loading is strict: every tensor's name and shape is checked against the layout its config.json describes (a missing,
extra or misshapen tensor is an error naming it, never a silent random init), and the heads are checked against the
target (hidden size, vocabulary, and for native exports and checkpoints the target's architecture fingerprint). A file
that stores the target's lm_head for shared heads must hold exactly that lm_head. An export is written into a temporary
directory and renamed (`common.write_export`), so an interrupted export never leaves a half-written file. The layouts themselves live in
`medusa_layouts.py`.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from medusa_like.drafters.base import CHECKPOINT_KEY, DrafterMismatchError, check_fits, target_name
from medusa_like.drafters.kinds import Codec
from medusa_like.drafters.medusa import MEDUSA as MEDUSA_KIND
from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads
from medusa_like.formats import medusa_layouts as layouts
from medusa_like.formats.common import read_config, read_safetensors, same_weights, write_export
from medusa_like.formats.medusa_layouts import (
    FORMATS,
    MEDUSA,
    NATIVE,
    TGI,
    VLLM,
    WEIGHTS_FILE,
    HeadsFormatError,
    check_names,
    check_shapes,
)
from medusa_like.targets import target_fingerprint, weights_identity

# ---- export ----


def _heads_tensors(heads: MedusaHeads, dtype: torch.dtype) -> tuple[dict, list[torch.Tensor] | None]:
    """(native block tensors, own projections or None), detached on the CPU in `dtype`."""
    state = {name: t.detach().cpu().to(dtype).contiguous() for name, t in heads.state_dict().items()}
    blocks = {name: t for name, t in state.items() if name.startswith("blocks.")}
    if heads.config.shared_lm_head:
        return blocks, None
    return blocks, [state[layouts.projection_name(NATIVE, k, 0)] for k in range(heads.num_heads)]


def _layout(fmt: str, heads: MedusaHeads, target: PreTrainedModel, target_name: str, dtype) -> tuple[dict, dict]:
    """(config.json, tensors) of `heads` in format `fmt`."""
    cfg = heads.config
    blocks, own = _heads_tensors(heads, dtype)
    if fmt == NATIVE:
        tensors = dict(blocks)
        for k, proj in enumerate(own or []):
            tensors[layouts.projection_name(NATIVE, k, 0)] = proj
        config = layouts.native_config(cfg, target_name, target_fingerprint(target.config), weights_identity(target))
        return config, tensors
    if fmt == TGI:
        reason = layouts.tgi_refusal(cfg)
        if reason:
            raise ValueError(f"cannot export these heads in format 'tgi': {reason}; use format=medusa or vllm")
        return layouts.tgi_config(cfg, target_name), layouts.blocks_to(TGI, blocks, cfg.num_heads, 1)
    tensors = layouts.blocks_to(fmt, blocks, cfg.num_heads, cfg.num_layers)
    lm_head = target.get_output_embeddings().weight.detach().cpu().to(dtype).contiguous()
    if fmt == MEDUSA:
        # the original layout has one projection per head: shared heads get copies of the target's lm_head
        for k in range(cfg.num_heads):
            tensors[layouts.projection_name(MEDUSA, k, cfg.num_layers)] = own[k] if own else lm_head.clone()
        return layouts.medusa_config(cfg, target_name), tensors
    if fmt == VLLM:
        for k, proj in enumerate(own or [lm_head]):
            tensors[layouts.projection_name(VLLM, k, cfg.num_layers)] = proj
        return layouts.vllm_config(cfg, original_lm_head=own is None), tensors
    raise ValueError(f"unknown export format {fmt!r}; expected one of {FORMATS}")


def export_heads(
    heads: MedusaHeads,
    out_dir: str | Path,
    format: str,
    target_model: PreTrainedModel,
    target_name: str,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `heads` for `target_model` into `out_dir` in `format` (native, medusa, vllm or tgi); returns the directory.

    `target_name` goes into config.json (Medusa's and TGI's base_model_name_or_path: a hub id or a path the serving
    engine can open). `dtype` casts the written tensors (default: the heads' own dtype).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; expected one of {FORMATS}")
    check_fits(heads.config.hidden_size, heads.config.vocab_size, target_model, source="being exported")
    dtype = dtype or next(heads.parameters()).dtype
    config, tensors = _layout(format, heads, target_model, target_name, dtype)
    files = {
        WEIGHTS_FILE[format]: lambda path: save_file(tensors, str(path), metadata={"format": "pt"}),
        "config.json": lambda path: path.write_text(json.dumps(config, indent=2) + "\n"),
    }
    return write_export(out_dir, files, {"drafter": "medusa", "format": format}, overwrite)


# ---- import ----


def _build(cfg: HeadsConfig, blocks: dict, projections: list[torch.Tensor] | None) -> MedusaHeads:
    """MedusaHeads holding exactly these tensors (names and shapes already checked), in their dtype."""
    state = dict(blocks)
    for k, proj in enumerate(projections or []):
        state[layouts.projection_name(NATIVE, k, 0)] = proj
    dtype = next(iter(blocks.values())).dtype
    heads = MedusaHeads(cfg).to(dtype)
    heads.load_state_dict(state, strict=True)
    return heads.eval()


def _resolve_projections(parsed: layouts.Parsed, target: PreTrainedModel, file: Path) -> layouts.Parsed:
    """Per-head projections all equal to the target's lm_head become shared; a stored lm_head must be the target's."""
    lm_head = target.get_output_embeddings().weight.detach()
    if parsed.stored_lm_head is not None and not same_weights(parsed.stored_lm_head, lm_head):
        raise DrafterMismatchError(
            f"{file}: lm_heads.0.weight (original_lm_head: true) differs from the lm_head of target "
            f"{target_name(target)!r}: these heads were exported for another target"
        )
    if parsed.projections is not None and all(same_weights(p, lm_head) for p in parsed.projections):
        parsed.projections = None
        parsed.config = HeadsConfig(**{**parsed.config.to_dict(), "shared_lm_head": True})
    return parsed


def _read_directory(path: Path, target: PreTrainedModel) -> tuple[MedusaHeads, dict]:
    config = read_config(path)
    try:
        fmt = layouts.detect_format(config)
    except ValueError as err:
        raise HeadsFormatError(f"{path / 'config.json'}: {err}") from err
    file = path / WEIGHTS_FILE[MEDUSA if fmt == "medusa_or_tgi" else fmt]
    tensors = read_safetensors(file)
    if fmt == NATIVE:
        parsed = layouts.parse_native(config, tensors, file)
    elif fmt == VLLM:
        parsed = layouts.parse_vllm(config, tensors, file)
    else:
        parsed = layouts.parse_medusa_or_tgi(config, tensors, file, target.config.get_text_config().vocab_size)
    cfg = parsed.config
    check_fits(
        cfg.hidden_size,
        cfg.vocab_size,
        target,
        parsed.meta.get("target_fingerprint"),
        f"from {path}",
        parsed.meta.get("target_weights"),
    )
    parsed = _resolve_projections(parsed, target, file)
    return _build(parsed.config, parsed.blocks, parsed.projections), parsed.meta


def read_heads(path: Path, target_model: PreTrainedModel) -> tuple[MedusaHeads, dict]:
    """Heads from a native, Medusa, vLLM or TGI directory (detected from config.json), checked against the target,
    and what the directory says about itself: format, target name, fingerprint.

    Shared-projection heads come back with `lm_heads = None`: pass the target's lm_head to their forward.
    """
    return _read_directory(Path(path), target_model)


# ---- training checkpoints ----


def heads_from_checkpoint(checkpoint: dict, path: Path, target_model: PreTrainedModel) -> tuple[MedusaHeads, dict]:
    """(heads, meta) from a loaded training checkpoint (`common.read_checkpoint`), checked against the target.

    The training module's contract: state_dict["heads.*"] holds the heads and checkpoint["medusa_like"] holds
    {"heads_config": HeadsConfig.to_dict(), "target": str, "target_fingerprint": str}.
    """
    info = checkpoint[CHECKPOINT_KEY]
    try:
        cfg = HeadsConfig(**info["heads_config"])
    except (KeyError, TypeError, ValueError) as err:
        raise HeadsFormatError(f"{path}: {CHECKPOINT_KEY}['heads_config'] is unusable: {err}") from err
    state = {k.removeprefix("heads."): v for k, v in checkpoint["state_dict"].items() if k.startswith("heads.")}
    spec = layouts.native_spec(cfg)
    layout = f"its heads_config (num_heads={cfg.num_heads}, num_layers={cfg.num_layers}, shared={cfg.shared_lm_head})"
    check_names(state, spec, f"{path} state_dict['heads.*']", layout)
    check_shapes(state, spec, path, layout)
    check_fits(
        cfg.hidden_size,
        cfg.vocab_size,
        target_model,
        info.get("target_fingerprint"),
        f"from {path}",
        info.get("target_weights"),
    )
    blocks = {name: t for name, t in state.items() if name.startswith("blocks.")}
    own = None if cfg.shared_lm_head else [state[layouts.projection_name(NATIVE, k, 0)] for k in range(cfg.num_heads)]
    meta = {
        "format": "checkpoint",
        "heads_config": cfg.to_dict(),
        "target": info.get("target"),
        "target_fingerprint": info.get("target_fingerprint"),
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
    }
    return _build(cfg, blocks, own), meta


def is_heads_config(config: dict) -> bool:
    try:
        layouts.detect_format(config)
    except ValueError:
        return False
    return True


MEDUSA_KIND.attach(Codec(FORMATS, is_heads_config, read_heads, heads_from_checkpoint, export_heads))
