"""What every entry point writes into its run directory, and how a run records its settings to check a resumed run
against (`training/resume.py`, `evaluation/run_settings.py`: flat dotted keys).

Hydra's own `.hydra/config.yaml` keeps the interpolations (`${paths.output_dir}`, ...); `config.yaml` next to it is the
config the run actually used.
"""

from collections.abc import Iterable, Mapping
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from medusa_like.io import write_text


def resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


@rank_zero_only
def save_config(run_config: dict, out_dir: Path) -> None:
    write_text(Path(out_dir) / "config.yaml", OmegaConf.to_yaml(run_config))


def flatten(value, prefix: str) -> dict:
    """{dotted key: value} of nested mappings; lists and scalars are leaves."""
    if not isinstance(value, Mapping):
        return {prefix: value}
    flat = {}
    for key, item in value.items():
        flat.update(flatten(item, f"{prefix}.{key}"))
    return flat


def config_values(cfg: DictConfig, keys: Iterable[str]) -> dict:
    """The values of `cfg` at `keys` (None where it has none), resolved, as flat dotted keys."""
    settings = {}
    for key in keys:
        value = OmegaConf.select(cfg, key, default=None)
        settings.update(
            flatten(OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value, key)
        )
    return settings
