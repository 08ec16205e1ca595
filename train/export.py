"""Export trained heads: `python -m train.export heads.path=<dir or .ckpt> format=medusa|vllm|tgi|native out=<dir>`.

The heads are loaded strictly and checked against the target (`model.target=...`): its hidden size, vocabulary and,
for native directories and checkpoints, its architecture fingerprint. The target also supplies the lm_head that the
Medusa and vLLM layouts store for shared-projection heads. `export(cfg)` is the importable entry point; `main` is the
thin Hydra wrapper. Serving command lines for each format are in docs/serving.md.
"""

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from medusa_like.export import export_heads, read_heads
from medusa_like.formats import NATIVE
from medusa_like.targets import load_target, resolve_target


def config_target_name(cfg: DictConfig) -> str:
    """The target name written into config.json: ours for native, one a serving engine can open for the others."""
    if cfg.get("base_model"):
        return str(cfg.base_model)
    target = str(cfg.model.target)
    return target if cfg.format == NATIVE else resolve_target(target)


def export(cfg: DictConfig) -> Path:
    target, _ = load_target(str(cfg.model.target), dtype=cfg.model.get("dtype") or "float32", device="cpu")
    heads, source = read_heads(cfg.heads.path, target)
    dtype = getattr(torch, cfg.dtype) if cfg.get("dtype") else None
    out = export_heads(
        heads, cfg.out, cfg.format, target_model=target, target_name=config_target_name(cfg), dtype=dtype
    )
    c = heads.config
    print(
        f"read {source['format']} heads from {cfg.heads.path}: {c.num_heads} heads x {c.num_layers} layers, "
        f"{'shared' if c.shared_lm_head else 'own'} projection"
    )
    print(f"wrote format={cfg.format} to {out}: {sorted(p.name for p in out.iterdir())}")
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
def main(cfg: DictConfig) -> None:
    export(cfg)


if __name__ == "__main__":
    main()
