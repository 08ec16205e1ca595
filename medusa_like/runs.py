"""What every entry point writes into its run directory, and where a run resumes from.

Hydra's own `.hydra/config.yaml` keeps the interpolations (`${paths.output_dir}`, ...); `config.yaml` next to it is the
config the run actually used.
"""

from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from medusa_like.io import write_text

LAST = "last"  # ckpt_path=last: the newest checkpoints/last.ckpt of this run directory or of its sibling runs


def resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


@rank_zero_only
def save_config(run_config: dict, out_dir: Path) -> None:
    write_text(Path(out_dir) / "config.yaml", OmegaConf.to_yaml(run_config))


def last_checkpoint(ckpt_path: str | None, out_dir: Path) -> str | None:
    """`ckpt_path` itself, or for `last` the newest `checkpoints/last.ckpt` in `out_dir` or a sibling run directory."""
    if ckpt_path != LAST:
        if ckpt_path is not None and not Path(ckpt_path).is_file():
            raise FileNotFoundError(f"ckpt_path={ckpt_path!r} does not exist (a .ckpt file, or 'last')")
        return ckpt_path
    out_dir = Path(out_dir)
    candidates = [out_dir / "checkpoints" / "last.ckpt", *out_dir.parent.glob("*/checkpoints/last.ckpt")]
    found = [p for p in candidates if p.is_file()]
    if not found:
        raise FileNotFoundError(f"ckpt_path=last: no checkpoints/last.ckpt in {out_dir} or next to it")
    return str(max(found, key=lambda p: p.stat().st_mtime))
