"""Exact export and import of draft heads: our native directory, the original Medusa layout, vLLM and TGI.

    save_heads(heads, "runs/x/heads", target, "smollm2-135m-instruct")       # native: config.json + model.safetensors
    export_heads(heads, "out/vllm", "vllm", target_model=target, target_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    heads = load_heads("out/vllm", target)                                   # any of the four, detected from config
    heads, meta = heads_from_checkpoint("runs/x/checkpoints/last.ckpt")

Loading is strict: every tensor's name and shape is checked against the layout its config.json describes (a missing,
extra or misshapen tensor is an error naming it, never a silent random init), and the heads are checked against the
target (hidden size, vocabulary, and for native exports and checkpoints the target's architecture fingerprint). A file
that stores the target's lm_head for shared heads must hold exactly that lm_head. Files are written to a temporary name
and renamed, so an interrupted export never leaves a half-written file. The layouts themselves live in `formats.py`.
"""

import json
import logging
import os
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from . import formats
from .formats import (
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
from .heads import HeadsConfig, MedusaHeads
from .targets import target_fingerprint

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "medusa_like"  # the training module's entry in a Lightning checkpoint
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class TargetMismatchError(ValueError):
    """Heads that do not fit the target they are loaded onto or exported for."""


# ---- the target ----


def target_dims(target: PreTrainedModel) -> tuple[int, int]:
    """(hidden size, vocabulary size) of a causal LM, from its text config."""
    config = target.config.get_text_config()
    return config.hidden_size, config.vocab_size


def target_lm_head(target: PreTrainedModel) -> torch.Tensor:
    return target.get_output_embeddings().weight.detach()


def _target_name(target: PreTrainedModel) -> str:
    return getattr(target.config, "name_or_path", None) or type(target).__name__


def check_target(cfg: HeadsConfig, target: PreTrainedModel, fingerprint: str | None, source: str) -> None:
    """Raise TargetMismatchError naming what differs: hidden size, vocabulary, or the architecture fingerprint.

    `source` completes "heads ... have": e.g. "from runs/x/heads" or "being exported".
    """
    hidden, vocab = target_dims(target)
    name = _target_name(target)
    if cfg.hidden_size != hidden:
        raise TargetMismatchError(
            f"heads {source} have hidden size {cfg.hidden_size}, but target {name!r} has hidden size {hidden}"
        )
    if cfg.vocab_size != vocab:
        raise TargetMismatchError(
            f"heads {source} have vocabulary size {cfg.vocab_size}, but target {name!r} has vocabulary size {vocab}"
        )
    actual = target_fingerprint(target.config)
    if fingerprint is not None and fingerprint != actual:
        raise TargetMismatchError(
            f"heads {source} were trained on a target with fingerprint {fingerprint}, but target {name!r} has "
            f"fingerprint {actual}: same hidden size and vocabulary, another architecture (layers, attention heads "
            f"or MLP size)"
        )


def same_weights(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal after rounding both to the less precise of their dtypes (an fp32 lm_head exported in bf16 still counts)."""
    if a.shape != b.shape:
        return False
    dtype = a.dtype if torch.finfo(a.dtype).eps >= torch.finfo(b.dtype).eps else b.dtype
    return torch.equal(a.detach().cpu().to(dtype), b.detach().cpu().to(dtype))


# ---- files ----


def _atomic_write(path: Path, write) -> None:
    """Run write(tmp) and rename tmp to path; an interruption leaves the old file (or none), never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # readable by a serving container's user, whatever the writer's default
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json(path: Path, data: dict) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"))


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        found = sorted(p.name for p in directory.iterdir())
        raise HeadsFormatError(f"{directory} has no config.json, so its format is unknown; it holds {found}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HeadsFormatError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise HeadsFormatError(f"{path} holds a {type(config).__name__}, expected a JSON object")
    return config


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        others = sorted(p.name for p in path.parent.glob("*") if p.suffix in _WEIGHT_SUFFIXES)
        hint = " (pickled .pt/.bin weights are not read: convert them to safetensors)" if others else ""
        raise HeadsFormatError(f"weights file {path} is missing; the directory holds {others}{hint}")
    try:
        return load_file(str(path), device="cpu")
    except SafetensorError as err:
        raise HeadsFormatError(f"{path} is not a readable safetensors file (truncated or corrupted?): {err}") from err


def _check_out_dir(out: Path, weights_name: str) -> None:
    """Refuse a directory holding other weight files: vLLM would load every *.safetensors it finds there."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"export target {out} exists and is not a directory")
    stale = sorted(p.name for p in out.glob("*") if p.suffix in _WEIGHT_SUFFIXES and p.name != weights_name)
    if stale:
        raise FileExistsError(
            f"{out} already holds weight files {stale}, which serving engines would read alongside "
            f"{weights_name}: export into an empty directory"
        )


# ---- export ----


def _heads_tensors(heads: MedusaHeads, dtype: torch.dtype) -> tuple[dict, list[torch.Tensor] | None]:
    """(native block tensors, own projections or None), detached on the CPU in `dtype`."""
    state = {name: t.detach().cpu().to(dtype).contiguous() for name, t in heads.state_dict().items()}
    blocks = {name: t for name, t in state.items() if name.startswith("blocks.")}
    if heads.config.shared_lm_head:
        return blocks, None
    return blocks, [state[formats.projection_name(NATIVE, k, 0)] for k in range(heads.num_heads)]


def _layout(fmt: str, heads: MedusaHeads, target: PreTrainedModel, target_name: str, dtype) -> tuple[dict, dict]:
    """(config.json, tensors) of `heads` in format `fmt`."""
    cfg = heads.config
    blocks, own = _heads_tensors(heads, dtype)
    if fmt == NATIVE:
        tensors = dict(blocks)
        for k, proj in enumerate(own or []):
            tensors[formats.projection_name(NATIVE, k, 0)] = proj
        return formats.native_config(cfg, target_name, target_fingerprint(target.config)), tensors
    if fmt == TGI:
        reason = formats.tgi_refusal(cfg)
        if reason:
            raise ValueError(f"cannot export these heads in format 'tgi': {reason}; use format=medusa or vllm")
        return formats.tgi_config(cfg, target_name), formats.blocks_to(TGI, blocks, cfg.num_heads, 1)
    tensors = formats.blocks_to(fmt, blocks, cfg.num_heads, cfg.num_layers)
    lm_head = target_lm_head(target).cpu().to(dtype).contiguous()
    if fmt == MEDUSA:
        # the original layout has one projection per head: shared heads get copies of the target's lm_head
        for k in range(cfg.num_heads):
            tensors[formats.projection_name(MEDUSA, k, cfg.num_layers)] = own[k] if own else lm_head.clone()
        return formats.medusa_config(cfg, target_name), tensors
    if fmt == VLLM:
        for k, proj in enumerate(own or [lm_head]):
            tensors[formats.projection_name(VLLM, k, cfg.num_layers)] = proj
        return formats.vllm_config(cfg, original_lm_head=own is None), tensors
    raise ValueError(f"unknown export format {fmt!r}; expected one of {FORMATS}")


def export_heads(
    heads: MedusaHeads,
    out_dir: str | Path,
    format: str = NATIVE,
    *,
    target_model: PreTrainedModel,
    target_name: str,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `heads` for `target_model` into `out_dir` in `format` (native, medusa, vllm or tgi); returns the directory.

    `target_name` goes into config.json (Medusa's and TGI's base_model_name_or_path: a hub id or a path the serving
    engine can open). `dtype` casts the written tensors (default: the heads' own dtype).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; expected one of {FORMATS}")
    check_target(heads.config, target_model, None, "being exported")
    dtype = dtype or next(heads.parameters()).dtype
    config, tensors = _layout(format, heads, target_model, target_name, dtype)
    out = Path(out_dir)
    weights_name = WEIGHTS_FILE[format]
    _check_out_dir(out, weights_name)
    out.mkdir(parents=True, exist_ok=True)
    _write_safetensors(out / weights_name, tensors)
    _write_json(out / "config.json", config)  # last: a directory with a config has its weights complete
    return out


def save_heads(heads: MedusaHeads, out_dir: str | Path, target_model: PreTrainedModel, target_name: str) -> Path:
    """Native export: config.json (sizes, shared projection, target name and fingerprint) + model.safetensors."""
    return export_heads(heads, out_dir, NATIVE, target_model=target_model, target_name=target_name)


# ---- import ----


def _build(cfg: HeadsConfig, blocks: dict, projections: list[torch.Tensor] | None) -> MedusaHeads:
    """MedusaHeads holding exactly these tensors (names and shapes already checked), in their dtype."""
    state = dict(blocks)
    for k, proj in enumerate(projections or []):
        state[formats.projection_name(NATIVE, k, 0)] = proj
    dtype = next(iter(blocks.values())).dtype
    heads = MedusaHeads(cfg).to(dtype)
    heads.load_state_dict(state, strict=True)
    return heads.eval()


def _resolve_projections(parsed: formats.Parsed, target: PreTrainedModel, file: Path) -> formats.Parsed:
    """Per-head projections all equal to the target's lm_head become shared; a stored lm_head must be the target's."""
    lm_head = target_lm_head(target)
    if parsed.stored_lm_head is not None and not same_weights(parsed.stored_lm_head, lm_head):
        raise TargetMismatchError(
            f"{file}: lm_heads.0.weight (original_lm_head: true) differs from the lm_head of target "
            f"{_target_name(target)!r}: these heads were exported for another target"
        )
    if parsed.projections is not None and all(same_weights(p, lm_head) for p in parsed.projections):
        parsed.projections = None
        parsed.config = HeadsConfig(**{**parsed.config.to_dict(), "shared_lm_head": True})
    return parsed


def _read_directory(path: Path, target: PreTrainedModel) -> tuple[MedusaHeads, dict]:
    config = read_config(path)
    try:
        fmt = formats.detect_format(config)
    except ValueError as err:
        raise HeadsFormatError(f"{path / 'config.json'}: {err}") from err
    file = path / WEIGHTS_FILE[MEDUSA if fmt == "medusa_or_tgi" else fmt]
    tensors = read_safetensors(file)
    if fmt == NATIVE:
        parsed = formats.parse_native(config, tensors, file)
    elif fmt == VLLM:
        parsed = formats.parse_vllm(config, tensors, file)
    else:
        parsed = formats.parse_medusa_or_tgi(config, tensors, file, target_dims(target)[1])
    check_target(parsed.config, target, parsed.meta.get("target_fingerprint"), f"from {path}")
    parsed = _resolve_projections(parsed, target, file)
    return _build(parsed.config, parsed.blocks, parsed.projections), parsed.meta


def read_heads(path: str | Path, target_model: PreTrainedModel) -> tuple[MedusaHeads, dict]:
    """`load_heads`, also returning what the source says about itself: format, target name, fingerprint."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"heads path {path} does not exist")
    if path.is_file():
        if path.suffix != ".ckpt":
            raise HeadsFormatError(f"{path} is a file: expected a heads directory with config.json, or a .ckpt")
        heads, meta = heads_from_checkpoint(path)
        check_target(heads.config, target_model, meta["target_fingerprint"], f"from {path}")
        return heads, {**meta, "format": "checkpoint"}
    return _read_directory(path, target_model)


def load_heads(path: str | Path, target_model: PreTrainedModel) -> MedusaHeads:
    """Heads from a native, Medusa, vLLM or TGI directory (detected from config.json) or a training checkpoint.

    Shared-projection heads come back with `lm_heads = None`: pass the target's lm_head to their forward.
    """
    return read_heads(path, target_model)[0]


# ---- training checkpoints ----


def _torch_load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # Lightning may store hyper-parameters as arbitrary objects, which only a full unpickling restores
        log.warning("%s holds more than tensors: unpickling it fully (load checkpoints you trust only)", path)
        return torch.load(path, map_location="cpu", weights_only=False)


def heads_from_checkpoint(ckpt_path: str | Path) -> tuple[MedusaHeads, dict]:
    """(heads, meta) from a training checkpoint; meta = {heads_config, target, target_fingerprint, step, epoch}.

    The training module's contract: state_dict["heads.*"] holds the heads and checkpoint["medusa_like"] holds
    {"heads_config": HeadsConfig.to_dict(), "target": str, "target_fingerprint": str}.
    """
    path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        checkpoint = _torch_load(path)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:
        raise HeadsFormatError(f"{path} is not a readable torch checkpoint (truncated or corrupted?): {err}") from err
    if not isinstance(checkpoint, dict) or CHECKPOINT_KEY not in checkpoint or "state_dict" not in checkpoint:
        keys = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise HeadsFormatError(
            f"{path} is not a medusa_like training checkpoint: expected 'state_dict' and {CHECKPOINT_KEY!r}, got {keys}"
        )
    info = checkpoint[CHECKPOINT_KEY]
    try:
        cfg = HeadsConfig(**info["heads_config"])
    except (KeyError, TypeError) as err:
        raise HeadsFormatError(f"{path}: {CHECKPOINT_KEY}['heads_config'] is unusable: {err}") from err
    state = {k.removeprefix("heads."): v for k, v in checkpoint["state_dict"].items() if k.startswith("heads.")}
    spec = formats.native_spec(cfg)
    layout = f"its heads_config (num_heads={cfg.num_heads}, num_layers={cfg.num_layers}, shared={cfg.shared_lm_head})"
    check_names(state, spec, f"{path} state_dict['heads.*']", layout)
    check_shapes(state, spec, path, layout)
    blocks = {name: t for name, t in state.items() if name.startswith("blocks.")}
    own = None if cfg.shared_lm_head else [state[formats.projection_name(NATIVE, k, 0)] for k in range(cfg.num_heads)]
    meta = {
        "heads_config": cfg.to_dict(),
        "target": info.get("target"),
        "target_fingerprint": info.get("target_fingerprint"),
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
    }
    return _build(cfg, blocks, own), meta
