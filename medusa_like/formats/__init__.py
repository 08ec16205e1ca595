"""Drafters on disk: one entry point to load any drafter directory or training checkpoint, and to export one.

    drafter = load_drafter("runs/x/drafter", target)          # detected from config.json, or a .ckpt
    export_drafter(drafter, "exports/vllm", "vllm", target, "HuggingFaceTB/SmolLM2-135M-Instruct")

Each drafter kind (`drafters/registry.py`) reads and writes its own formats through its codec, which the kind's format
module here attaches to it when this package is imported (every module of the package is imported once, so a new
kind's codec module needs no line elsewhere): Medusa heads as native, medusa, vllm and tgi (`heads_io.py`, layouts in
`medusa_layouts.py`); the EAGLE-3 drafter as native, eagle3 (vLLM), eagle3_sglang (`eagle3.py`) and gguf (llama.cpp,
`gguf.py`); the block drafter as native and dflash (`block.py`). Loading is strict everywhere and checks the drafter against the target (`drafters.base.check_fits`).
"""

import importlib
import pkgutil
from pathlib import Path

import torch

from medusa_like.drafters.base import CHECKPOINT_KEY
from medusa_like.drafters.protocol import Drafter
from medusa_like.drafters.registry import all_kinds, kind_named, kind_of, trainable_kinds
from medusa_like.formats.common import FormatError, drafter_source, read_checkpoint, read_config

for _module in pkgutil.iter_modules(__path__):  # each codec module attaches its codec to its kind
    importlib.import_module(f"{__name__}.{_module.name}")


def read_drafter(path: str | Path, target) -> tuple[Drafter, dict]:
    """(drafter, what its source says about itself) from a directory of any format or a training checkpoint."""
    path = drafter_source(path)
    if path.is_file():
        checkpoint = read_checkpoint(path, CHECKPOINT_KEY)
        name = checkpoint[CHECKPOINT_KEY].get("kind", "medusa")  # a checkpoint that names no kind holds heads
        try:
            kind = kind_named(name)
        except ValueError as err:
            raise FormatError(f"{path}: {err}") from err
        return kind.from_checkpoint(checkpoint, path, target)
    config = read_config(path)
    kinds = all_kinds()
    found = [kind for kind in kinds.values() if kind.formats and kind.recognises(config)]
    named = (config.get("medusa_like") or {}).get("kind") if isinstance(config.get("medusa_like"), dict) else None
    if len(found) > 1 or (found and named is not None and found[0].name != named):
        architectures = config.get("architectures")
        raise FormatError(
            f"{path / 'config.json'} contradicts itself: architectures {architectures} and medusa_like.kind "
            f"{named!r} name different drafter kinds ({sorted(kind.name for kind in found)})"
        )
    if found:
        return found[0].read(path, target)
    formats = {name: kind.formats for name, kind in kinds.items() if kind.formats}
    raise FormatError(f"{path / 'config.json'} is not a drafter config of any known format: {formats}")


def load_drafter(path: str | Path, target) -> Drafter:
    return read_drafter(path, target)[0]


DEFAULT_LEARNED = "eagle3"  # the learned part of a fresh combined drafter (`learned=`) when none is named


def resolve_drafter(drafter: str | Path | Drafter, target, **options) -> Drafter:
    """A drafter for `target` from what a user names: an object as it is, a directory or checkpoint loaded, or a kind's
    name built fresh with `options`, where a combined drafter's `learned=` directory or checkpoint is loaded too."""
    kinds = all_kinds()
    if isinstance(drafter, str) and drafter in kinds:
        kind = kinds[drafter]
        if kind.takes_learned:
            options["learned"] = resolve_learned(options.pop("learned", DEFAULT_LEARNED), target, options)
        return kind.fresh(target, **options)
    if isinstance(drafter, str) and not Path(drafter).exists():
        raise FileNotFoundError(
            f"drafter={drafter!r} is not a registered drafter kind ({sorted(kinds)}), and no drafter directory or "
            ".ckpt file of that name exists"
        )
    if isinstance(drafter, (str, Path)):
        return load_drafter(drafter, target)
    if not callable(getattr(drafter, "proposer", None)):  # not a drafter object at all: say what is expected
        raise TypeError(
            f"drafter={drafter!r}: expected a drafter kind's name ({sorted(kinds)}), a drafter directory or .ckpt "
            "file, or a drafter object (medusa_like.drafters.protocol.Drafter)"
        )
    return drafter


def resolve_learned(learned, target, options: dict) -> Drafter:
    """A combined drafter's learned part from what a user names: an object, a trainable kind's name (built fresh
    with the kind options in `options`, which are taken out of it) or a drafter directory or checkpoint."""
    if isinstance(learned, str) and learned in all_kinds():
        trainable = trainable_kinds()
        if learned not in trainable:
            raise ValueError(
                f"learned={learned!r}: a learned drafter, one of {trainable} for a fresh one, or a drafter directory "
                "or checkpoint"
            )
        kind_options = {k: options.pop(k) for k in list(options) if k not in ("store", "cost_model")}
        return kind_named(learned).fresh(target, **kind_options)
    if isinstance(learned, (str, Path)):
        return load_drafter(learned, target)
    return learned


def export_drafter(
    drafter: Drafter,
    out_dir: str | Path,
    format: str,
    target,
    target_name: str,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` for `target` in `format` into `out_dir` (a new directory, or a previous export with
    `overwrite`); returns the directory."""
    kind = kind_of(drafter)
    if format not in kind.formats:
        raise ValueError(f"a {kind.name} drafter exports as one of {kind.formats}, not {format!r}")
    return kind.export(drafter, out_dir, format, target, target_name, dtype, overwrite)


def save_drafter(drafter: Drafter, out_dir: str | Path, target, target_name: str, overwrite: bool = False) -> Path:
    """The native format, what `load_drafter` and `MedusaLikeModel.from_pretrained(drafter=...)` read back."""
    return export_drafter(drafter, out_dir, "native", target, target_name, overwrite=overwrite)
