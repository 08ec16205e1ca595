"""Training-step benchmark: where an EAGLE-3 training step's time goes, on the experiment's own batches.

    python -m eval.bench train_step                                   # the default experiment (make run's training)
    python -m eval.bench train_step --steps 8 --out bench_train_step.json data.name=sharegpt_text_800 ...
    python -m eval.bench train_step --steps 12 --compile-drafter      # the drafter's part by torch.compile

Composes the train config with the given Hydra overrides (the data must be built already: `make run` or
`python -m train.train` builds it), then for each of `--steps` training batches (after one untimed) times, in the
run's precision: the frozen target's layers (`target_hidden`), its output projection and top-k labels with the
vocabulary check (the whole vocabulary, EAGLE-3's rule) and without it (the draft vocabulary's rows alone), the
drafter's unrolled forward, and its backward with the optimizer step. Reports the medians. A step with data echoing
(`data.module.echo=E`) reads the target once every E steps, so its cost is (read) / E + (drafter).

`--compile-drafter` runs the drafter's layer, its projection and the loss through `torch.compile` (Inductor's default
settings: the batches' sizes vary, which a frozen, autotuned graph would recompile for), forward and backward, and
reports how long its first step (the compile) took: what compiling the drafter's side of training would buy.
"""

import statistics
from typing import Annotated

import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from medusa_like.apps import CONFIG_DIR
from medusa_like.apps.config_checks import register_resolvers
from medusa_like.data.prepare import load_model
from medusa_like.targets import output_logits
from medusa_like.training.build import build_module
from medusa_like.training.eagle3_module import Eagle3Module

from .harness import Report, table, timed

PHASES = ("target layers", "output projection + top-k (vocabulary check)", "output projection + top-k (draft rows)",
          "drafter forward", "drafter backward + optimizer")  # fmt: skip


def train_config(overrides: list[str]):
    """The train config of the default experiment with `overrides`, set as Hydra's current one (paths resolve)."""
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=["experiment=smollm2_eagle3", *overrides], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    return cfg


def run(
    *overrides: Annotated[str, "Hydra overrides of the train config"],
    steps: Annotated[int, "timed batches (after one untimed)"] = 6,
    compile_drafter: Annotated[bool, "the drafter's layer, projection and loss by torch.compile"] = False,
    out: str = "bench_train_step.json",
) -> Report:
    """Where an EAGLE-3 training step's time goes on the experiment's own batches."""
    cfg = train_config(list(overrides))
    target, _ = load_model(cfg.model)
    datamodule = instantiate(cfg.data.module)
    datamodule.setup("fit")
    module = build_module(cfg, target)
    if not isinstance(module, Eagle3Module):
        raise ValueError("the training step benchmark times an EAGLE-3 drafter (drafter=eagle3)")
    module.train()
    if compile_drafter:
        drafter = module.drafter
        drafter.forward = torch.compile(drafter.forward, dynamic=False)  # [B, T] batches: one shape
        drafter.logits = torch.compile(drafter.logits, dynamic=True)  # the labelled rows: a count a batch
        module.loss_fn = torch.compile(module.loss_fn, dynamic=True)
    optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=1e-4)  # the step's cost, not the run's schedule
    precision = str(cfg.trainer.precision)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled="bf16" in precision)
    batches = iter(datamodule.in_order(datamodule.train_set))
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    layers = module.drafter.config.aux_layer_ids
    rows, k = module.drafter.token_ids, module.top_k
    for step in range(steps + 1):
        batch = next(batches)
        wanted = module._wanted(batch, training=True)
        with autocast:
            read, hidden = timed(lambda: module.target_hidden(batch, layers))  # noqa: B023
            last = hidden[..., -module.target.config.get_text_config().hidden_size :][wanted]  # [n, h]
            with torch.no_grad():  # the labels' projection with the vocabulary check, then the draft rows alone
                full, _ = timed(lambda: output_logits(module.target, last).float()[:, rows].topk(k))  # noqa: B023
                draft, _ = timed(lambda: output_logits(module.target, last, rows).float().topk(k))  # noqa: B023
            outputs = module._compute_target_outputs(batch, wanted, module.vocab_check)
            module._target_outputs = lambda *_: outputs  # noqa: B023  the drafter's part alone from here
            forward, (loss, *_) = timed(lambda: module._forward(batch, training=True))  # noqa: B023
            del module._target_outputs
        backward, _ = timed(lambda: (loss.backward(), optimizer.step(), optimizer.zero_grad()))  # noqa: B023
        if step:  # the first batch warms up
            for phase, ms in zip(PHASES, (read, full, draft, forward, backward), strict=True):
                times[phase].append(ms)
        else:
            first_ms = forward + backward  # the drafter's first step: its compile, with --compile-drafter
    medians = {phase: statistics.median(ms) for phase, ms in times.items()}
    shape = f"{datamodule.batch_size} x {datamodule.max_length}"
    shown = table(
        f"one training step, ms (median of {steps}; batches of {shape}, {precision})",
        ["phase", "ms"],
        [[phase, f"{ms:.0f}"] for phase, ms in medians.items()]
        + [["drafter's first step (untimed above)", f"{first_ms:.0f}"]],
    )
    overrides = ["experiment=smollm2_eagle3", *overrides]
    result = {"overrides": overrides, "precision": precision, "batch": shape, "compile_drafter": compile_drafter,
              "median_ms": medians, "first_drafter_step_ms": first_ms}  # fmt: skip
    return Report(result, [shown], out=out)
