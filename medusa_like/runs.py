"""What every entry point writes into its run directory. (Where a training run resumes from: `training/resume.py`.)

Hydra's own `.hydra/config.yaml` keeps the interpolations (`${paths.output_dir}`, ...); `config.yaml` next to it is the
config the run actually used.
"""

from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from medusa_like.io import write_text


def resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


@rank_zero_only
def save_config(run_config: dict, out_dir: Path) -> None:
    write_text(Path(out_dir) / "config.yaml", OmegaConf.to_yaml(run_config))
