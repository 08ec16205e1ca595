"""What the evaluation and tree-search apps share: the model from a config, the question sets, the run directory."""

from pathlib import Path

import torch
from omegaconf import DictConfig

from medusa_like.data.prepare import load_model as load_target_model
from medusa_like.data.split import split_token_counts
from medusa_like.decoding.tree import save_tree
from medusa_like.drafters.vocab import DraftVocab
from medusa_like.evaluation.questions import Question, load_questions, select
from medusa_like.evaluation.tree_search import search
from medusa_like.model import MedusaLikeModel


def load_model(cfg: DictConfig) -> MedusaLikeModel:
    """The target of `cfg.model` with the drafter of `cfg.drafter` (zero-init heads when `drafter.path` is null).

    A drafter made for another target raises `medusa_like.drafters.base.DrafterMismatchError` naming what differs.
    """
    if cfg.drafter.path is not None and not Path(cfg.drafter.path).exists():
        raise FileNotFoundError(
            f"drafter.path={cfg.drafter.path!r} does not exist (a drafter directory or a .ckpt file)"
        )
    dtype = cfg.target.dtype
    target, tokenizer = load_target_model(
        cfg.model, **({"dtype": dtype} if "dtype" in cfg.model.loader and dtype else {})
    )
    if dtype:
        target = target.to(getattr(torch, dtype))
    model = MedusaLikeModel.from_pretrained(
        target,
        drafter=cfg.drafter.path,
        tokenizer=tokenizer,
        num_heads=cfg.drafter.num_heads,
        backend=cfg.target.backend,
    )
    size = cfg.drafter.get("draft_vocab_size")
    if size and model.drafter_kind == "medusa":  # restrict the heads' projection to the training data's top tokens
        vocab_size = target.config.get_text_config().vocab_size
        split = cfg.validation  # the training data's split settings
        model.draft_vocab = medusa_draft_vocab(
            cfg.drafter.vocab_data, size, vocab_size, split.val_fraction, split.split_seed
        )
    return model


def medusa_draft_vocab(data_dir: str, size: int, vocab_size: int, val_fraction: float, split_seed: int) -> DraftVocab:
    """The `size` most frequent assistant tokens of a training dataset's training split (`data.dir`), for Medusa heads."""
    if not data_dir:
        raise ValueError("drafter.draft_vocab_size for Medusa heads needs drafter.vocab_data=<the training data.dir>")
    counts, _ = split_token_counts(data_dir, vocab_size, val_fraction, split_seed)
    return DraftVocab.from_counts(counts, int(size))


def question_set(data: DictConfig, validation: DictConfig) -> list[Question]:
    """The questions of one `data`-like section (source, path, limit, per_category)."""
    split = {}
    if data.source == "validation":
        split = dict(
            source=validation.source,
            val_fraction=validation.val_fraction,
            split_seed=validation.split_seed,
            limit=None if data.get("limit") is None else data.get("limit") + data.get("skip", 0),
            max_turns=data.get("max_turns", 2),
        )
    questions = load_questions(data.source, data.get("path"), **split)
    return select(questions, data.get("limit"), data.get("per_category"), data.get("skip", 0))


def run_dir(cfg: DictConfig) -> Path:
    """`cfg.out_dir`, else the run directory (`paths.output_dir`: Hydra's run directory)."""
    out = Path(cfg.out_dir) if cfg.get("out_dir") else Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"eval.threads must be >= 1 or null, got {threads}")
        torch.set_num_threads(threads)


def calibration_prompts(cfg: DictConfig, model) -> list[torch.Tensor]:
    """First-turn prompt ids [1, T] of the calibration questions, under the target's chat template."""
    questions = question_set(cfg.tree_search.calibration, cfg.validation)
    return [model.chat_ids([{"role": "user", "content": q.turns[0]}]) for q in questions]


def run_search(cfg: DictConfig, model, out_path: Path) -> dict:
    """Search with `cfg.tree_search`, save the chosen tree to `out_path`; return what was measured."""
    prompts = calibration_prompts(cfg, model)
    ts = cfg.tree_search
    result = search(
        model, prompts, ts.timing_prompts, cfg.eval.max_new_tokens, ts.budget, ts.budgets, ts.dynamic, cfg.eval.k_max
    )
    meta = dict(
        calibration={"source": ts.calibration.source, "prompts": len(prompts)},
        target=str(cfg.model.name_or_path),
        drafter=None if cfg.drafter.path is None else str(cfg.drafter.path),
        timings=result["timings"],
    )
    if result["kind"] == "dynamic":
        spec = result["spec"]
        save_tree([], out_path, dynamic={"depth": spec.depth, "top_k": spec.top_k, "num_nodes": spec.num_nodes}, **meta)
    else:
        meta.update(budget=result["label"], predicted_tau=result["predicted_tau"], head_topk_accuracy=result["topk"])
        save_tree(result["spec"], out_path, **meta)
    return {**result, "path": str(out_path)}
