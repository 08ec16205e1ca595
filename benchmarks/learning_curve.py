"""Learning curve of an EAGLE-3 drafter: held-out acceptance and the drafter's own tau against supervised tokens seen.

    python -m train.train experiment=smollm2_eagle3_curve hydra.run.dir=runs/curve/train   # checkpoints at milestones
    python -m train.train experiment=smollm2_eagle3_long_cached hydra.run.dir=runs/long_cached/train   # 8 epochs
    python -m eval.bench learning_curve runs/curve/train --epochs-run runs/long_cached/train    # curve.json, curve.png
    python -m eval.bench learning_curve runs/long/train --epochs-run runs/long/train    # _long: both in one run

The training run saves `checkpoints/tokens-<n>.ckpt` when the supervised tokens it trained on reach each milestone
(`training.checkpoints.TokenMilestones`). For each, this script measures on the run's own validation rows the per-depth
top-1 acceptance of the training-time test and the chain tau they imply (what `val/sim_tau_chain` reports), then the
drafter's tau alone when it decodes validation prompts (first turns, the target's chat template, greedy, a dynamic
tree): generated tokens per target forward, bonus token included. It prints a table, writes `curve.json` and draws
`curve.png` in the run directory. Decoding is lossless by construction; tau, not speed, is measured here.

`--epochs-run` (comma-separated) adds the validations of another run over the same data, read from its CSV log (every epoch's end in
the cached long recipe; every few hundred steps of the single epoch of `smollm2_eagle3_long`, which can also be the
run itself), at the supervised tokens seen by then (steps x an epoch's supervised tokens / its steps, counted from the
data as TokenMilestones counts them, an echoed row once per serving), and the tau alone of the drafter it exported (its
best checkpoint). Every point is written to curve.json as soon as it is measured, and a rerun with the same settings
measures only what is missing.
"""

import csv
import itertools
import json
import logging
from pathlib import Path
from typing import Annotated

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from medusa_like.apps.config_checks import register_resolvers
from medusa_like.data.prepare import load_model
from medusa_like.evaluation.questions import load_questions, select
from medusa_like.formats import load_drafter
from medusa_like.io import read_training_checkpoint, write_json
from medusa_like.model import MedusaLikeModel
from medusa_like.targets import chat_input_ids
from medusa_like.training.build import build_module
from medusa_like.training.ttt import simulated_tau

from .harness import Report

log = logging.getLogger(__name__)


@torch.no_grad()
def held_out(cfg, target, datamodule, checkpoint: Path) -> dict[str, float]:
    """The run's validation metrics for the drafter of `checkpoint` (per-depth accuracies, chain tau), computed as
    the training run's validation computes them: on its rows (the first `trainer.limit_val_batches` batches, or that
    share of them, where it set one), from its target cache when it had one."""
    module = build_module(cfg, target)
    module.load_state_dict(read_training_checkpoint(checkpoint, ("state_dict",), trusted=True)["state_dict"])
    module.prepare_target_cache(datamodule)
    module.eval()
    batches = datamodule.val_dataloader()
    limit = cfg.trainer.get("limit_val_batches")
    if isinstance(limit, float):  # a share of the batches, as Lightning counts it
        limit = int(len(batches) * limit)
    if limit is not None:
        batches = itertools.islice(batches, limit)
    for index, batch in enumerate(batches):
        module.validation_step(batch, index)
    metrics = {f"val/{name}": float(m.compute()) for name, m in module.val_metrics.items() if m.update_count}
    depths = range(1, module.ttt_steps + 1)
    metrics["val/sim_tau_chain"] = simulated_tau([metrics[f"val/acc_top1_depth{d}"] for d in depths])
    return metrics


def decoding_tau(target, tokenizer, drafter, prompts, max_new_tokens: int, tree: str) -> float:
    """Tokens per target forward of `drafter` alone over `prompts`, pooled."""
    model = MedusaLikeModel(target, tokenizer, drafter)
    tokens = forwards = 0
    for ids in prompts:
        out = model.generate(ids, max_new_tokens=max_new_tokens, tree=tree, remember=False)
        tokens += out.stats.new_tokens
        forwards += out.stats.target_forwards  # the prompt's forward included, as every tau here counts it
    return tokens / max(forwards, 1)


def epoch_points(run_dir: Path, datamodule) -> list[dict]:
    """The validation rows of a several-epoch run's CSV log, at the supervised tokens seen by each; the row of the
    step whose checkpoint the run exported (its best) is marked `exported`."""
    per_epoch = sum(int(batch["loss_mask"].sum()) for batch in datamodule.train_dataloader())
    steps_per_epoch = len(datamodule.train_dataloader())
    best = [int(p.stem.rsplit("step", 1)[1]) for p in (run_dir / "checkpoints").glob("best-*step*.ckpt")]
    points = []
    for log_file in sorted(run_dir.glob("csv/*/metrics.csv")):
        with log_file.open() as f:
            for row in csv.DictReader(f):
                if not row.get("val/acc_top1_depth1"):
                    continue
                step = int(row["step"]) + 1  # Lightning logs validation at the last finished step's index
                point = {k: float(v) for k, v in row.items() if k.startswith("val/") and v}
                point.update(tokens=round(step * per_epoch / steps_per_epoch), step=step, run="epochs")
                point["epoch_tokens"] = per_epoch
                point["source"] = f"{run_dir}@step{step}"
                point["exported"] = step in best
                points.append(point)
    return points


def _cell(value) -> str:
    return "" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def plot(points: list[dict], path: Path, depths: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(points, key=lambda p: p["tokens"])  # one line per depth across both runs' points
    tokens = [p["tokens"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for d in range(1, depths + 1):
        left.plot(tokens, [p[f"val/acc_top1_depth{d}"] for p in points], marker="o", label=f"depth {d}")
    left.set(xscale="log", xlabel="supervised tokens seen", ylabel="held-out top-1 acceptance", ylim=(0, 1))
    right.plot(tokens, [p["val/sim_tau_chain"] for p in points], marker="o", label="chain tau from acceptance")
    decoded = [p for p in points if p.get("tau_alone") is not None]
    right.plot(
        [p["tokens"] for p in decoded], [p["tau_alone"] for p in decoded], marker="s",
        label="tau decoding alone (dynamic tree)",
    )  # fmt: skip
    right.set(xscale="log", xlabel="supervised tokens seen", ylabel="tokens per target forward")
    epochs = [p["epoch_tokens"] for p in points if p.get("epoch_tokens") and p["tokens"] > p["epoch_tokens"]]
    if epochs:  # past one epoch the tokens are the same conversations again, not new ones
        for axis in (left, right):
            axis.axvline(min(epochs), color="gray", linestyle=":", label="one epoch: later points repeat the data")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(
    run_dir: Annotated[Path, "a training run made with TokenMilestones (checkpoints/tokens-*)"],
    *,
    prompts: Annotated[int, "validation prompts decoded per point"] = 16,
    max_new_tokens: int = 96,
    tree: Annotated[str, "the tree the drafter decodes with alone"] = "dynamic",
    epochs_run: Annotated[tuple[Path, ...], "runs on the same data whose CSV logs hold their validations"] = (),
) -> Report:
    """Held-out acceptance and the drafter's own tau of an EAGLE-3 drafter against supervised tokens seen."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    run_dir = Path(run_dir)
    milestones_file = run_dir / "checkpoints" / "milestones.json"
    if not milestones_file.is_file():
        raise FileNotFoundError(
            f"{milestones_file} does not exist: train with experiment=smollm2_eagle3_curve (or _long) first"
        )
    register_resolvers()
    cfg = OmegaConf.create(OmegaConf.load(run_dir / "config.yaml"))
    target, tokenizer = load_model(cfg.model)
    questions = select(
        load_questions(
            "validation",
            source=cfg.data.source,
            val_fraction=cfg.data.val_fraction,
            split_seed=cfg.data.split_seed,
            limit=prompts,
            max_turns=1,
        ),
        prompts,
    )
    prompt_ids = [chat_input_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    datamodule = instantiate(cfg.data.module)
    datamodule.setup("fit")
    settings = {"prompts": len(prompt_ids), "max_new_tokens": max_new_tokens, "tree": tree}
    out_file = run_dir / "curve.json"
    earlier = json.loads(out_file.read_text()) if out_file.is_file() else {}
    done = (
        {p["source"]: p for p in earlier.get("points", []) if "source" in p}
        if earlier.get("settings") == settings
        else {}
    )
    points = []

    def record(point: dict) -> None:  # written at once: a rerun with the same settings measures only what is missing
        points.append(point)
        write_json(out_file, {"settings": settings, "points": points})

    for entry in json.loads(milestones_file.read_text()):
        checkpoint = run_dir / "checkpoints" / entry["path"]
        if str(checkpoint) in done:
            record(done[str(checkpoint)])
            continue
        metrics = held_out(cfg, target, datamodule, checkpoint)
        drafter = load_drafter(checkpoint, target)
        tau = decoding_tau(target, tokenizer, drafter, prompt_ids, max_new_tokens, tree)
        record({**entry, **metrics, "tau_alone": tau, "run": "milestones", "source": str(checkpoint)})
        log.info("%d tokens: %s, tau alone %.3f", entry["tokens"], metrics, tau)
    for run in epochs_run:
        for point in epoch_points(Path(run), datamodule):
            if point["source"] in done:
                record(done[point["source"]])
                continue
            if point.pop("exported", False):
                drafter = load_drafter(Path(run) / "drafter", target)
                point["tau_alone"] = decoding_tau(target, tokenizer, drafter, prompt_ids, max_new_tokens, tree)
            record(point)
            log.info("%s", point)
    depths = int(cfg.drafter.module.ttt_steps)
    plot(points, run_dir / "curve.png", depths)
    header = ["tokens", "step", *[f"val/acc_top1_depth{d}" for d in range(1, depths + 1)], "val/sim_tau_chain"]
    lines = ["| " + " | ".join([*header, "tau_alone"]) + " |", "|" + "---|" * (len(header) + 1)]
    lines += ["| " + " | ".join(_cell(p.get(k)) for k in [*header, "tau_alone"]) + " |" for p in points]
    return Report({"settings": settings, "points": points}, notes=lines, out=out_file)
