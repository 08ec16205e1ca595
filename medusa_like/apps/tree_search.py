"""Tree search: the tree that decodes fastest on this machine for a drafter (config: conf/eval.yaml).

    medusa-tree-search drafter.path=runs/<run>/drafter                      # budget=auto: time, keep the fastest
    medusa-tree-search drafter.path=... tree_search.budget=16 tree_search.out=trees/h16.json \
        tree_search.profile_out=trees/profile.json                          # Medusa heads
    medusa-evaluate drafter.path=... tree=trees/h16.json target.profile=trees/profile.json   # use them

Calibration prompts: the first turns of `tree_search.calibration` (the validation split by default, never trained on).
Medusa heads: each head's top-1..top-10 accuracy is measured teacher-forced over the target's greedy answers, the best
tree of each budget is built best-first, and every budget is timed. EAGLE-3: every (depth, top_k, num_nodes) of
`tree_search.dynamic` is timed. Combined and lookup drafters (`drafter.mode`): every budgeted tree of
`tree_search.budgeted` is timed on a full cost model measured first; with `tree_search.learned_alone`, the learned
drafter's own trees are timed too, alone (`tree_search.dynamic` for EAGLE-3, `tree_search.budgets` for Medusa heads),
and the fastest is saved as a tree file of its own (`tree_search.learned_out`), the tree the evaluation's
learned-alone method decodes with (`learned_tree=`). transformers' prompt lookup is timed at each
`tree_search.prompt_lookup` value, for the evaluation's baseline. The fastest tree is saved as a tree JSON that
`tree=` accepts (`tree_search.out`); what depends on the machine (the compile choice, the cost model,
the fastest prompt lookup) as the machine profile that `target.profile=` and `profile=` take
(`tree_search.profile_out`). `tree_search(cfg)` is importable; `main` is the Hydra app behind `medusa-tree-search`
and `python -m eval.tree_search`.
"""

import logging
import tempfile
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from medusa_like.apps import CONFIG_DIR
from medusa_like.apps.config_checks import EVAL_CHECKS, Accepted, check_config
from medusa_like.errors import one_line_errors
from medusa_like.evaluation.setup import SEARCH_FILES, load_eval_model, run_search, search_files, set_threads
from medusa_like.evaluation.tree_choice import budgeted_candidates, dynamic_candidates

log = logging.getLogger(__name__)

COLUMNS = (
    "tree",
    "nodes",
    "depth",
    "tau",
    "accepted draft/step",
    "draft ms/step",
    "verify ms/step",
    "tokens/s, geo. mean",
)


def timings_table(rows: list[dict], chosen, title: str) -> Table:
    """The timed trees as a table, the chosen one starred."""
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for r in rows:
        mark = " *" if r["budget"] == chosen else ""
        table.add_row(
            f"{r['budget']}{mark}",
            str(r["nodes"]),
            str(r["depth"]),
            f"{r['tau']:.2f}",
            f"{r['mean_accepted_draft']:.2f}",
            f"{r['draft_ms_per_step']:.1f}",
            f"{r['verify_ms_per_step']:.1f}",
            f"{r['tokens_per_second']:.1f}",
        )
    return table


def print_search(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    if result["timings"]:
        console.print(timings_table(result["timings"], result["label"], "tree budgets (calibration prompts)"))
    if result["topk"]:
        console.print("head top-1 accuracy: " + ", ".join(f"{t[0]:.2f}" for t in result["topk"]))
    alone = result.get("learned_alone")
    if alone and alone["timings"]:
        console.print(
            timings_table(alone["timings"], alone["label"], "the learned drafter alone (calibration prompts)")
        )
    console.print(f"fastest transformers prompt lookup: prompt_lookup_num_tokens={result['prompt_lookup_num_tokens']}")
    console.print(f"saved tree {result['label']} to {result['path']}, this machine's profile to {result['profile']}")
    if alone:
        console.print(f"saved the learned drafter's own tree {alone['label']} to {result['learned_tree']}")


# the candidate trees, checked by the functions that build them, before the target is loaded and measured
SEARCH_CHECKS = {
    "tree_search.dynamic": Accepted(dynamic_candidates),
    "tree_search.budgeted": Accepted(lambda b: budgeted_candidates(b.learned, b.num_nodes, b.lookup_depth, True)),
}


def tree_search(cfg: DictConfig) -> dict:
    """Load the model, search, save and print; returns `evaluation.setup.run_search`'s result."""
    check_config(cfg, EVAL_CHECKS | SEARCH_CHECKS)
    set_threads(cfg.eval.threads)
    torch.manual_seed(cfg.seed)
    files = search_files(cfg)
    for file, path in files.items():
        check_writable(path, *SEARCH_FILES[file])  # before the search, not after it
    model = load_eval_model(cfg)
    result = run_search(cfg, model, files)
    print_search(result)
    return result


def check_writable(path: Path, key: str, name: str) -> None:
    """Refuse a file (`tree_search.<key>`, named `name` by default) that could not be written once the search is done:
    a directory, or a place where no file can be made (a probe file is written there and removed)."""
    if path.is_dir():
        raise IsADirectoryError(f"tree_search.{key}={path} is a directory: name the file (e.g. {path / name})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.probe-"):
            pass
    except OSError as err:
        raise OSError(f"tree_search.{key}={path}: no file can be written there ({err})") from err


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
def main(cfg: DictConfig) -> None:
    log.info("config:\n%s", OmegaConf.to_yaml(cfg))
    with one_line_errors():
        tree_search(cfg)
