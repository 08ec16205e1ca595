"""Drafters on disk: one entry point to load any drafter directory or training checkpoint, and to export one.

    drafter = load_drafter("runs/x/drafter", target)          # detected from config.json, or a .ckpt
    export_drafter(drafter, "exports/vllm", "vllm", target, "HuggingFaceTB/SmolLM2-135M-Instruct")

Medusa heads: native, medusa, vllm, tgi (`heads_io.py`, layouts in `medusa_heads.py`); the EAGLE-3 drafter: native
eagle3 (vLLM) and eagle3_sglang, the layout vLLM and SGLang read (`eagle3.py`). Loading is strict everywhere and checks the drafter against
the target (`drafters.base.check_fits`).
"""

import pickle
from pathlib import Path

import torch

from medusa_like.drafters.base import CHECKPOINT_KEY, check_fits
from medusa_like.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from medusa_like.drafters.medusa import MedusaHeads
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.formats import eagle3, heads_io
from medusa_like.formats.common import FormatError, drafter_source, read_config

HEADS_FORMATS = heads_io.FORMATS
EAGLE3_FORMATS = eagle3.FORMATS


def read_drafter(path: str | Path, target) -> tuple[MedusaHeads | Eagle3Drafter, dict]:
    """(drafter, what its source says about itself) from a directory of any format or a training checkpoint."""
    path = drafter_source(path)
    if path.is_file():
        return _from_checkpoint(path, target)
    if eagle3.is_eagle3_config(read_config(path)):
        return eagle3.read_eagle3(path, target)
    return heads_io.read_heads(path, target)


def load_drafter(path: str | Path, target) -> MedusaHeads | Eagle3Drafter:
    return read_drafter(path, target)[0]


def export_drafter(
    drafter: MedusaHeads | Eagle3Drafter,
    out_dir: str | Path,
    format: str,
    target,
    target_name: str,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` for `target` in `format` into `out_dir` (a new directory, or a previous export with
    `overwrite`); returns the directory."""
    if isinstance(drafter, Eagle3Drafter):
        return eagle3.write_eagle3(drafter, out_dir, format, target, target_name, dtype, overwrite)
    if format not in HEADS_FORMATS:
        raise ValueError(f"Medusa heads export as one of {HEADS_FORMATS}, not {format!r}")
    return heads_io.export_heads(
        drafter, out_dir, format, target_model=target, target_name=target_name, dtype=dtype, overwrite=overwrite
    )


def save_drafter(drafter, out_dir: str | Path, target, target_name: str, overwrite: bool = False) -> Path:
    """The native format, what `load_drafter` and `MedusaLikeModel.from_pretrained(drafter=...)` read back."""
    return export_drafter(drafter, out_dir, "native", target, target_name, overwrite=overwrite)


def _from_checkpoint(path: Path, target) -> tuple[MedusaHeads | Eagle3Drafter, dict]:
    try:
        checkpoint = heads_io.torch_load(path)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:
        raise FormatError(f"{path} is not a readable torch checkpoint (truncated or corrupted?): {err}") from err
    info = checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(info, dict) or info.get("kind", "medusa") == "medusa":
        heads, meta = heads_io.read_heads(path, target)
        return heads, meta
    if info.get("kind") != "eagle3":
        raise FormatError(f"{path}: unknown drafter kind {info.get('kind')!r} in {CHECKPOINT_KEY!r}")
    try:
        config = Eagle3Config(**info["config"])
        vocab = DraftVocab(torch.tensor(info["draft_token_ids"], dtype=torch.long), config.vocab_size)
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(f"{path}: {CHECKPOINT_KEY} does not describe an EAGLE-3 drafter: {err}") from err
    check_fits(config.target_hidden_size, config.vocab_size, target, info.get("target_fingerprint"), f"from {path}")
    drafter = Eagle3Drafter(config, vocab)
    state = {k.removeprefix("drafter."): v for k, v in checkpoint["state_dict"].items() if k.startswith("drafter.")}
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise FormatError(f"{path}: the drafter's weights do not match its config: {err}") from err
    meta = {"format": "checkpoint", "target": info.get("target"), "target_fingerprint": info.get("target_fingerprint")}
    return drafter.eval(), {**meta, "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}
