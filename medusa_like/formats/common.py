"""What every drafter format shares: reading config.json and safetensors files with clear errors, and writing an
export directory whole.

An export is written into a temporary directory next to its destination and renamed into place, with a marker file
(`.medusa_like_export`) naming what it holds. An existing destination is only replaced when it holds nothing but a
previous export (its marker and the files that export wrote) and `overwrite` is asked: another model's weights, a
config, or any unknown file are never overwritten.
"""

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from medusa_like.drafters.base import CHECKPOINT_KEY, check_fits
from medusa_like.io import (
    CheckpointError,
    read_training_checkpoint,
    remove_stale_temporaries,
    temporary_name,
    write_json,
)

log = logging.getLogger(__name__)

MARKER = ".medusa_like_export"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class FormatError(ValueError):
    """A drafter directory, file or checkpoint that does not hold what its config says."""


def drafter_source(path: str | Path, error: type[FormatError] = FormatError) -> Path:
    """`path` as a drafter source: an existing directory, or a training checkpoint (.ckpt); anything else is refused."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"drafter path {path} does not exist (a drafter directory or a .ckpt file)")
    if path.is_file() and path.suffix != ".ckpt":
        raise error(f"{path} is a file: expected a drafter directory with config.json, or a .ckpt")
    return path


def read_checkpoint(path: Path, key: str) -> dict:
    """A training checkpoint holding `state_dict` and the training module's `key` entry; anything else is a
    `FormatError` naming the file."""
    try:
        return read_training_checkpoint(path, ("state_dict", key))
    except CheckpointError as err:
        raise FormatError(str(err)) from err


def drafter_from_checkpoint(checkpoint: dict, path: Path, target, sizes: tuple[int, int], build: Callable):
    """(drafter, meta) of a learned drafter's training checkpoint, once its kind's codec has read its config: the
    drafter's `sizes` (hidden size read, vocabulary) checked against `target` with the target and weights it records
    (`drafters.base.check_fits`), then `build()` (the drafter its config describes) loaded with the checkpoint's
    `drafter.*` weights, strictly."""
    info = checkpoint[CHECKPOINT_KEY]
    check_fits(*sizes, target, info.get("target_fingerprint"), f"from {path}", info.get("target_weights"))
    drafter = build()
    state = {k.removeprefix("drafter."): v for k, v in checkpoint["state_dict"].items() if k.startswith("drafter.")}
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise FormatError(f"{path}: the drafter's weights do not match its config: {err}") from err
    meta = {
        "format": "checkpoint",
        "target": info.get("target"),
        "target_fingerprint": info.get("target_fingerprint"),
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
    }
    return drafter.eval(), meta


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        found = sorted(p.name for p in directory.iterdir())
        raise FormatError(f"{directory} has no config.json, so its format is unknown; it holds {found}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise FormatError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise FormatError(f"{path} holds a {type(config).__name__}, expected a JSON object")
    return config


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        others = sorted(p.name for p in path.parent.glob("*") if p.suffix in WEIGHT_SUFFIXES)
        hint = " (pickled .pt/.bin weights are not read: convert them to safetensors)" if others else ""
        raise FormatError(f"weights file {path} is missing; the directory holds {others}{hint}")
    try:
        return load_file(str(path), device="cpu")
    except SafetensorError as err:
        raise FormatError(f"{path} is not a readable safetensors file (truncated or corrupted?): {err}") from err


def same_weights(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal after rounding both to the less precise of their dtypes (an fp32 lm_head exported in bf16 still counts)."""
    if a.shape != b.shape:
        return False
    dtype = a.dtype if torch.finfo(a.dtype).eps >= torch.finfo(b.dtype).eps else b.dtype
    return torch.equal(a.detach().cpu().to(dtype), b.detach().cpu().to(dtype))


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse a destination that holds anything but a previous export (and that one unless `overwrite`)."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"export destination {out} exists and is not a directory")
    if not out.exists():
        return
    remove_stale_temporaries(out)
    present = sorted(p.name for p in out.iterdir())
    if not present:
        return
    marker = out / MARKER
    if not marker.is_file():
        raise FileExistsError(
            f"{out} already holds {present} and is not a previous export of this package: nothing was written; "
            "export into a new or empty directory"
        )
    written = set(json.loads(marker.read_text()).get("files", []))
    unknown = [name for name in present if name not in written | {MARKER}]
    if unknown:
        raise FileExistsError(f"{out} holds files no export wrote ({unknown}): nothing was written")
    if not overwrite:
        raise FileExistsError(f"{out} holds a previous export ({sorted(written)}): pass overwrite=true to replace it")


def write_export(out_dir: str | Path, files: dict[str, Callable[[Path], None]], about: dict, overwrite: bool) -> Path:
    """Write `files` (name -> writer(path)) into `out_dir` as one unit: a temporary directory next to it, renamed
    into place. A previous export there is replaced only with `overwrite`."""
    out = Path(out_dir)
    check_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent)
    tmp = temporary_name(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, write in files.items():
            write(tmp / name)
            os.chmod(tmp / name, 0o644)  # readable by a serving container's user, whatever the writer's default
        write_json(tmp / MARKER, {**about, "files": sorted(files)})
        if out.exists():
            old = temporary_name(out.with_name(out.name + ".old"))
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
