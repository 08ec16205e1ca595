"""The Hydra applications: each module holds one importable function (`train`, `evaluate`, `tree_search`, `export`,
`distill`) and the `main` that both its console script (`medusa-train`, ...) and the checkout's `python -m train.train`
style entry points call.

The configs are found in one place for every app: `medusa_like/conf` in an installed wheel, the repository's `conf/`
(their source) when running from the checkout or an editable install.
"""

from pathlib import Path


def find_config_dir() -> str:
    """The directory holding train.yaml and the other configs, as an absolute path (what `hydra.main` accepts)."""
    package = Path(__file__).resolve().parents[1]  # medusa_like/
    candidates = (package / "conf", package.parent / "conf")  # installed wheel, then the checkout
    for candidate in candidates:
        if (candidate / "train.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"no configs (train.yaml) in {' or '.join(str(c) for c in candidates)}")


CONFIG_DIR = find_config_dir()
