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
from medusa_like.evaluation.lossless_report import failure_line
from medusa_like.evaluation.methods import METHODS, combined, learned_alone_tree, make_runners
from medusa_like.evaluation.prompt_loop import run_questions
from medusa_like.evaluation.run_settings import check_resume, config_settings, loaded_settings, write_settings
from medusa_like.evaluation.setup import load_eval_setup, question_set, run_dir, run_search, search_files, set_threads
from medusa_like.evaluation.summary import build_report
from medusa_like.evaluation.timing import warm_up
from medusa_like.forward import read_profile

log = logging.getLogger(__name__)

DEFAULT_PROMPT_LOOKUP = 10  # transformers' own default, where no machine profile measured the fastest

__all__ = ["METHODS", "choose_trees", "evaluate", "exit_code", "main"]


def choose_trees(cfg: DictConfig, model, searched: dict | None = None) -> tuple[object, object, str, dict | None]:
    """(the evaluated tree, the learned drafter's own tree or None, the tree's name, the search's result or None),
    each tree resolved once: `cfg.tree` and `cfg.learned_tree`; `tree=auto` runs the tree search first (the tree, the
    machine profile and the learned drafter's own tree written into the run directory; the model then runs as that
    profile says), unless the run being resumed searched already (`searched`: its result), whose files it uses."""
    if cfg.tree == "auto":
        result = searched or run_search(cfg, model, search_files(cfg))
        if searched:
            model.forward.use_profile(read_profile(result["profile"]))
        tree, learned = result["spec"], result["learned_alone"] and result["learned_alone"]["spec"]
        name = f"auto ({result['path']})"
    else:
        tree, learned, result = as_plain(cfg.tree), as_plain(cfg.learned_tree), None
        name = str(tree)
    tree = model.resolve_tree(tree)
    learned = learned_alone_tree(model, tree, learned) if combined(model) else None
    return tree, learned, name, result


def as_plain(value):
    """A config value as plain Python (a list of rank paths from a ListConfig)."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


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
    tree, learned_tree, tree_name, search_result = choose_trees(cfg, model, resumed and resumed["tree_search"])
    run_settings |= loaded_settings(model, search_result)
    if resumed:
        check_resume(out_dir, run_settings, complete=True)
    else:
        write_settings(out_dir, run_settings, search_result)
    prompt_lookup = cfg.eval.prompt_lookup_num_tokens
    if prompt_lookup == "auto":
        profile = model.forward.profile
        measured = profile and profile.prompt_lookup_num_tokens
        prompt_lookup = measured or DEFAULT_PROMPT_LOOKUP
    runners = make_runners(model, tree, prompt_lookup, cfg.eval.methods, learned_tree)

    total = sum(min(len(q.turns), cfg.data.max_turns) for q in questions)
    batch_size = cfg.eval.batch_size
    if cfg.eval.warmup:
        ids = model.chat_ids([{"role": "user", "content": questions[0].turns[0]}])
        warm_up(runners, ids, cfg.eval.max_new_tokens, batch_size)
    with tqdm(total=total, desc="prompts", unit="prompt") as bar:
        records = run_questions(
            model, questions, runners, cfg.eval.max_new_tokens, cfg.data.max_turns, tree, log_path, bar, batch_size
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
