"""Helpers shared by the evaluation and tree-search apps: the model, the question sets, the run directory."""

from pathlib import Path

import torch
from omegaconf import DictConfig

from medusa_like.model import MedusaLikeModel
from medusa_like.questions import Question, load_questions, select
from train.distill import load_model as load_target_model


def load_model(cfg: DictConfig) -> MedusaLikeModel:
    """The target of `cfg.model` with the heads of `cfg.heads` (zero-init heads when `heads.path` is null).

    Heads made for another target raise `medusa_like.export.TargetMismatchError` naming what differs.
    """
    if cfg.heads.path is not None and not Path(cfg.heads.path).exists():
        raise FileNotFoundError(f"heads.path={cfg.heads.path!r} does not exist (a heads directory or a .ckpt file)")
    dtype = cfg.target.dtype
    target, tokenizer = load_target_model(
        cfg.model, **({"dtype": dtype} if "dtype" in cfg.model.loader and dtype else {})
    )
    if dtype:
        target = target.to(getattr(torch, dtype))
    return MedusaLikeModel.from_pretrained(
        target, heads=cfg.heads.path, tokenizer=tokenizer, num_heads=cfg.heads.num_heads, backend=cfg.target.backend
    )


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
    """`cfg.out_dir`, else the Hydra run directory."""
    if cfg.get("out_dir"):
        out = Path(cfg.out_dir)
    else:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            raise ValueError("out_dir is null and no Hydra run is active: pass out_dir=<directory>")
        out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"eval.threads must be >= 1 or null, got {threads}")
        torch.set_num_threads(threads)
