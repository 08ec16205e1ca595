"""What every entry point writes into its run directory: the config with every interpolation resolved.

Hydra's own `.hydra/config.yaml` keeps the interpolations (`${paths.output_dir}`, ...); `config.yaml` next to it is the
config the run actually used.
"""

from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf


def resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


@rank_zero_only
def save_config(run_config: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(run_config))
