"""The Hydra applications: each module holds one importable function (`train`, `evaluate`, `tree_search`, `export`,
`distill`) and the `main` that the checkout's `python -m train.train` style entry points call. The console scripts
(`medusa-train`, ...) call the launchers below, which import that module first.

The configs are found in one place for every app: `medusa_like/conf` in an installed wheel, the repository's `conf/`
(their source) when running from the checkout or an editable install.

The apps need the `train` extra (Hydra, OmegaConf, Lightning, ...), which a plain `pip install medusa_like` leaves
out: installed without it, a console script says so in one line and exits with status 2 instead of a traceback.
"""

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

EXTRA_HINT = 'pip install "medusa_like[train]"'
MISSING_EXTRA_STATUS = 2  # a usage error, as argparse's: the command cannot run in this environment as installed


def find_config_dir() -> str:
    """The directory holding train.yaml and the other configs, as an absolute path (what `hydra.main` accepts)."""
    package = Path(__file__).resolve().parents[1]  # medusa_like/
    candidates = (package / "conf", package.parent / "conf")  # installed wheel, then the checkout
    for candidate in candidates:
        if (candidate / "train.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"no configs (train.yaml) in {' or '.join(str(c) for c in candidates)}")


CONFIG_DIR = find_config_dir()


@contextlib.contextmanager
def needs_train_extra(script: str) -> Iterator[None]:
    """Around a console script's import of its app: a third-party module missing (the `train` extra was not
    installed; `pip install "medusa_like[train]"` brings the base dependencies too) ends the command with one line
    naming the extra and exit status 2. A module of this package missing is a broken install: it keeps its traceback."""
    try:
        yield
    except ModuleNotFoundError as missing:
        if missing.name is None or missing.name.split(".")[0] == __name__.split(".")[0]:
            raise
        print(
            f"error: {script} needs the training dependencies (no module named {missing.name!r}); "
            f"install them with: {EXTRA_HINT}",
            file=sys.stderr,
        )
        raise SystemExit(MISSING_EXTRA_STATUS) from None


# The console scripts of pyproject.toml's [project.scripts]: each imports its app only when run.


def launcher(script: str, app: str):
    """The console script `script`: imports `medusa_like.apps.<app>` when run (naming the extra it needs when a
    dependency is missing) and runs its Hydra `main`."""

    def main():
        with needs_train_extra(script):
            module = importlib.import_module(f"medusa_like.apps.{app}")
        return module.main()

    main.__name__ = f"{app}_main"
    return main


train_main = launcher("medusa-train", "train")
evaluate_main = launcher("medusa-evaluate", "evaluate")
tree_search_main = launcher("medusa-tree-search", "tree_search")
export_main = launcher("medusa-export", "export")
distill_main = launcher("medusa-distill", "distill")
