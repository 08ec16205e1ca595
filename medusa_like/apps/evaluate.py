"""Evaluation: tau, honest speed against strong baselines, and losslessness, on any MT-Bench-form question set.

    medusa-evaluate data.path=/path/to/mt_bench_question.jsonl drafter.path=runs/<run>/drafter
    medusa-evaluate data.source=validation drafter.path=... tree=auto eval.max_new_tokens=64

The methods timed (`evaluation.methods`), the prompt loop with resume (`evaluation.prompt_loop`), the timing harness
(`evaluation.timing`) and the report (`evaluation.summary`, `evaluation.report`) live in `medusa_like.evaluation`;
this module wires them to a config. `evaluate(cfg)` is importable; `main` is the Hydra app behind `medusa-evaluate`
and `python -m eval.evaluate`.
"""

import logging
import sys

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from medusa_like.apps import CONFIG_DIR
from medusa_like.apps.config_checks import EVAL_CHECKS, check_config
from medusa_like.errors import one_line_errors
from medusa_like.evaluation.methods import METHODS, make_runners
from medusa_like.evaluation.prompt_loop import run_questions
from medusa_like.evaluation.report import failure_line
from medusa_like.evaluation.run_settings import check_resume, config_settings, loaded_settings, write_settings
from medusa_like.evaluation.setup import (
    apply_tree_settings,
    load_eval_setup,
    question_set,
    run_dir,
    run_search,
    set_threads,
)
from medusa_like.evaluation.summary import build_report
from medusa_like.evaluation.timing import warm_up

log = logging.getLogger(__name__)

DEFAULT_PROMPT_LOOKUP = 10  # transformers' own default, when no tree search measured the fastest

__all__ = ["METHODS", "choose_tree", "evaluate", "exit_code", "main"]


def choose_tree(cfg: DictConfig, model, out_dir, searched: dict | None = None) -> tuple[object, str, dict | None]:
    """The tree of `cfg.tree`; `auto` runs the tree search (calibrate, time, keep the fastest) first, unless the run
    being resumed searched already (`searched`: its result), whose tree it keeps."""
    if cfg.tree == "auto":
        result = searched or jsonable(run_search(cfg, model, out_dir / "tree.json"), model)
        return model.resolve_tree(result["path"]), f"auto ({result['path']})", result
    tree = OmegaConf.to_container(cfg.tree) if OmegaConf.is_config(cfg.tree) else cfg.tree
    return model.resolve_tree(tree), str(tree), None


def jsonable(result: dict, model) -> dict:
    """The tree search's result with its tree spec as the JSON that `save_tree` writes."""
    return {**result, "spec": model.resolve_tree(result["spec"]).to_json()}


def evaluate(cfg: DictConfig) -> dict:
    """Run the whole evaluation of `cfg` (conf/eval.yaml); write the reports; return report.json's content."""
    check_config(cfg, EVAL_CHECKS)
    set_threads(cfg.eval.threads)
    torch.manual_seed(cfg.seed)
    out_dir = run_dir(cfg)
    log_path = out_dir / "prompts.jsonl"
    if log_path.exists() and not cfg.eval.resume:
        raise FileExistsError(f"{log_path} exists: continue that run with eval.resume=true, or use another out_dir")
    run_settings = config_settings(cfg)
    resumed = check_resume(out_dir, run_settings)  # before anything is loaded: a run of other settings is refused
    questions = question_set(cfg.data, cfg.validation)
    model, store_filling = load_eval_setup(cfg)
    tree, tree_name, search_result = choose_tree(cfg, model, out_dir, resumed and resumed["tree_search"])
    run_settings |= loaded_settings(model, search_result and search_result["path"])
    if resumed:
        check_resume(out_dir, run_settings, complete=True)
    else:
        write_settings(out_dir, run_settings, search_result)
    settings = apply_tree_settings(model, search_result["path"] if search_result else cfg.tree)
    prompt_lookup = cfg.eval.prompt_lookup_num_tokens
    if prompt_lookup == "auto":
        prompt_lookup = settings.get("prompt_lookup_num_tokens", DEFAULT_PROMPT_LOOKUP)
    learned_tree = settings.get("learned_alone")  # the tree file's tree for the learned drafter alone, if any
    runners = make_runners(model, tree, prompt_lookup, cfg.eval.methods, learned_tree)

    total = sum(min(len(q.turns), cfg.data.max_turns) for q in questions)
    if cfg.eval.warmup:
        ids = model.chat_ids([{"role": "user", "content": questions[0].turns[0]}])
        warm_up(runners, ids, cfg.eval.max_new_tokens)
    with tqdm(total=total, desc="prompts", unit="prompt") as bar:
        records = run_questions(
            model, questions, runners, cfg.eval.max_new_tokens, cfg.data.max_turns, tree, log_path, bar
        )
    return build_report(
        cfg,
        model,
        records,
        tree,
        tree_name,
        search_result,
        questions,
        out_dir,
        prompt_lookup,
        store_filling,
        learned_tree,
    )


def exit_code(report: dict, fail_on_mismatch: bool) -> int:
    """1 when `fail_on_mismatch` and some output of this project's methods differs from greedy on the same forward,
    (a), or from transformers' greedy as it ships, (g), where (g) ran (`losslessness.failures`); else 0."""
    return 1 if fail_on_mismatch and not report["summary"]["lossless"] else 0


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
def main(cfg: DictConfig) -> None:
    log.info("config:\n%s", OmegaConf.to_yaml(cfg))
    with one_line_errors():
        report = evaluate(cfg)
    failed = failure_line(report)
    if failed:  # said whatever the exit status: the report's claim does not hold
        print(f"{failed} (report: {run_dir(cfg) / 'report.md'})", file=sys.stderr)
    code = exit_code(report, cfg.eval.fail_on_mismatch)
    if code:
        sys.exit(code)
