"""Export a trained drafter: `medusa-export drafter.path=<dir or .ckpt> format=<format> out=<dir>`.

Medusa heads export as native, medusa, vllm or tgi; the EAGLE-3 drafter as native, eagle3 (vLLM), eagle3_sglang or
gguf (llama.cpp); the block drafter as native or dflash (vLLM and SGLang). The
drafter is loaded strictly and checked against the target of the `model` group (hidden size, vocabulary and, where
recorded, the architecture fingerprint); the target also supplies the lm_head that the Medusa and vLLM layouts store
for shared-projection heads. `export(cfg)` is importable; `main` is the Hydra app behind `medusa-export` and
`python -m train.export`.
"""

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from medusa_like.apps import CONFIG_DIR
from medusa_like.apps.config_checks import Accepted, Flag, FloatDtype, check_config
from medusa_like.data.prepare import load_model
from medusa_like.errors import one_line_errors
from medusa_like.formats import export_drafter, read_drafter
from medusa_like.formats.gguf import PRECISIONS, gguf_precision
from medusa_like.runs import resolved, save_config
from medusa_like.targets import resolve_target

GGUF_TYPES = tuple(PRECISIONS)  # `dtype` of format=gguf: f32, f16, q8_0
EXPORT_CHECKS = {
    "overwrite": Flag(),
    # GGUF's own types for format=gguf alone (q8_0 is no torch dtype); a torch floating-point dtype for the others
    "dtype": (Accepted(gguf_precision, when=("format", "gguf")), FloatDtype(optional=True, unless=("format", "gguf"))),
    "model.dtype": FloatDtype(optional=True),
}


def config_target_name(cfg: DictConfig) -> str:
    """The target name written into config.json: ours for native, one a serving engine can open for the others."""
    if cfg.get("base_model"):
        return str(cfg.base_model)
    target = str(cfg.model.name_or_path)
    return target if cfg.format == "native" else resolve_target(target)


def export(cfg: DictConfig) -> Path:
    """Read `drafter.path`, check it against the target, write it as `format` to `out`; returns the output directory."""
    check_config(cfg, EXPORT_CHECKS)
    save_config(resolved(cfg), Path(cfg.paths.output_dir))
    target, _ = load_model(cfg.model, device="cpu")
    drafter, source = read_drafter(cfg.drafter.path, target)
    dtype = cfg.get("dtype")
    dtype = getattr(torch, dtype) if dtype and dtype not in GGUF_TYPES else dtype
    out = export_drafter(
        drafter, cfg.out, cfg.format, target, config_target_name(cfg), dtype=dtype, overwrite=cfg.overwrite
    )
    kind = type(drafter).__name__
    print(f"read {source['format']} {kind} from {cfg.drafter.path}")
    print(f"wrote format={cfg.format} to {out}: {sorted(p.name for p in out.iterdir())}")
    return out


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="export")
def main(cfg: DictConfig) -> None:
    with one_line_errors():
        export(cfg)
