"""Tree search: the tree of a node budget that maximises expected acceptance, from the heads' measured accuracies.

    python -m eval.tree_search heads.path=runs/<run>/heads                          # budget=auto: time, keep fastest
    python -m eval.tree_search heads.path=runs/<run>/heads tree_search.budget=16 tree_search.out=trees/h16.json
    python -m eval.evaluate heads.path=runs/<run>/heads tree=trees/h16.json ...      # use it

Calibration: the target answers the first turn of `tree_search.calibration` prompts greedily (the validation split by
default, never trained on); each head's top-1..top-10 accuracy is measured teacher-forced over those answers; the
best tree of each budget is built best-first (`medusa_like.tree.greedy_tree`); with budget=auto every budget is timed
on this machine (tau and tokens/s, interleaved per prompt) and the fastest is saved. Config: conf/eval.yaml.
"""

import logging
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from eval.common import load_model, question_set, run_dir, set_threads
from medusa_like.tree import save_tree
from medusa_like.tree_search import fastest, head_topk_accuracy, predicted_tau, time_trees, trees_for_budgets

log = logging.getLogger(__name__)


def calibration_prompts(cfg: DictConfig, model) -> list[torch.Tensor]:
    """First-turn prompt ids [1, T] of the calibration questions, under the target's chat template."""
    questions = question_set(cfg.tree_search.calibration, cfg.data.validation)
    return [model.chat_ids([{"role": "user", "content": q.turns[0]}]) for q in questions]


def greedy_sequences(model, prompts, max_new_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """(prompt + the target's greedy answer [1, L], prompt length) for each prompt."""
    out = []
    for ids in prompts:
        result = model.generate(ids, max_new_tokens=max_new_tokens, tree="none")
        out.append((result.sequences, ids.shape[1]))
    return out


def parse_budget(budget) -> int | str:
    if budget == "auto":
        return "auto"
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
        return budget
    raise ValueError(f"tree_search.budget must be 'auto' or a number of nodes >= 0, got {budget!r}")


def search(cfg: DictConfig, model, out_path: Path) -> dict:
    """Calibrate, build and (for budget=auto) time trees; save the chosen one to `out_path`; return what was measured."""
    budget = parse_budget(cfg.tree_search.budget)
    prompts = calibration_prompts(cfg, model)
    sequences = greedy_sequences(model, prompts, cfg.eval.max_new_tokens)
    topk = head_topk_accuracy(model, sequences, cfg.eval.k_max)
    budgets = list(cfg.tree_search.budgets) if budget == "auto" else [budget]
    trees = trees_for_budgets(topk, budgets)
    rows = []
    if budget == "auto":
        timing = prompts[: max(cfg.tree_search.timing_prompts, 1)]
        rows = time_trees(model, timing, trees, cfg.eval.max_new_tokens)
        for row in rows:
            row["predicted_tau"] = predicted_tau(trees[row["budget"]], topk)
        budget = fastest(rows)["budget"]
    paths = trees[budget]
    save_tree(
        paths,
        out_path,
        budget=budget,
        predicted_tau=predicted_tau(paths, topk),
        head_topk_accuracy=topk,
        calibration={"source": cfg.tree_search.calibration.source, "prompts": len(prompts)},
        target=str(cfg.model.name_or_path),
        heads=None if cfg.heads.path is None else str(cfg.heads.path),
        timings=rows,
    )
    return {"path": str(out_path), "budget": budget, "paths": [list(p) for p in paths], "topk": topk, "timings": rows}


def print_search(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    if result["timings"]:
        table = Table(title="tree budgets (calibration prompts)")
        for col in ("budget", "nodes", "depth", "predicted tau", "tau", "accepted draft/step", "tokens/s"):
            table.add_column(col, justify="right")
        for r in result["timings"]:
            mark = " *" if r["budget"] == result["budget"] else ""
            table.add_row(
                f"{r['budget']}{mark}",
                str(r["nodes"]),
                str(r["depth"]),
                f"{r['predicted_tau']:.2f}",
                f"{r['tau']:.2f}",
                f"{r['mean_accepted_draft']:.2f}",
                f"{r['tokens_per_second']:.1f}",
            )
        console.print(table)
    top1 = ", ".join(f"{t[0]:.2f}" for t in result["topk"])
    console.print(f"head top-1 accuracy: {top1}; saved a {result['budget']}-node tree to {result['path']}")


def tree_search(cfg: DictConfig) -> dict:
    """The importable entry point: load the model, search, save and print; returns `search`'s result."""
    set_threads(cfg.eval.threads)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    out_path = Path(cfg.tree_search.out) if cfg.tree_search.out else run_dir(cfg) / "tree.json"
    result = search(cfg, model, out_path)
    print_search(result)
    return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    log.info("config:\n%s", OmegaConf.to_yaml(cfg))
    tree_search(cfg)


if __name__ == "__main__":
    main()
