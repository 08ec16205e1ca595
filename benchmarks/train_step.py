"""Training-step benchmark: where a drafter's training step's time goes on its experiment's own batches, the
supervised positions it serves a second, and each part's arithmetic rate beside this machine's peak.

    python -m eval.bench train_step                                   # make run's EAGLE-3 training (smollm2_eagle3)
    python -m eval.bench train_step --experiment smollm2_block        # the block drafter's, same regime
    python -m eval.bench train_step --steps 8 --out bench_train_step.json drafter.module.anchors=96 ...

Composes the train config of `--experiment` with the given Hydra overrides (the data must be built already: `make
run` or `python -m train.train` builds it), then for each of `--steps` training batches (after one untimed) times, in
the run's precision: the frozen target's layers (`target_hidden`), its output projection and top-k labels with the
vocabulary check (the whole vocabulary, EAGLE-3's rule) and without it (the draft vocabulary's rows alone), the
drafter's forward (EAGLE-3's unrolled steps, or the block drafter's blocks) and its backward with the optimizer step.
Reports the medians, the positions a step supervises (rows with a label, summed over unrolled steps or block
positions) and how many a second a step serves: a step with data echoing (`data.module.echo=E`) reads the target once
every E steps, so its time is (read + labels) / E + (drafter).

Each part's GFLOP/s counts its products' multiply-adds (2 per weight per row; attention and elementwise work left
out), and the peak is one large product of this dtype measured here in the same command (`F.linear` over
[4096, 576] x [576, 1536]: the shape of the target's layers at a batch's rows).
"""

import statistics
from typing import Annotated

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from medusa_like.apps import CONFIG_DIR
from medusa_like.apps.config_checks import register_resolvers
from medusa_like.data.prepare import load_model
from medusa_like.targets import output_logits
from medusa_like.training.build import build_module
from medusa_like.training.feature_labels import FeatureLabelsModule

from .harness import Report, median_ms, table, timed

PHASES = ("target layers", "output projection + top-k (vocabulary check)", "output projection + top-k (draft rows)",
          "drafter forward", "drafter backward + optimizer")  # fmt: skip


def train_config(experiment: str, overrides: list[str]):
    """The train config of `experiment` with `overrides`, set as Hydra's current one (paths resolve)."""
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=[f"experiment={experiment}", *overrides], return_hydra_config=True)
    HydraConfig().set_config(cfg)
    return cfg


def peak_gflops(dtype: torch.dtype, rows: int = 4096, inner: int = 576, outer: int = 1536) -> float:
    """This machine's rate for one large product of `dtype` (F.linear [rows, inner] x [inner, outer]), GFLOP/s."""
    x, w = torch.randn(rows, inner).to(dtype), torch.randn(outer, inner).to(dtype)
    with torch.no_grad():
        ms = median_ms(lambda: F.linear(x, w), 10, warmup=3)
    return 2 * rows * inner * outer / ms / 1e6


def linear_weights(module: torch.nn.Module) -> int:
    """Multiply-adds a row costs through `module`'s linear layers: the sum of their weights' sizes."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def run(
    *overrides: Annotated[str, "Hydra overrides of the train config"],
    experiment: Annotated[str, "the training experiment (conf/experiment)"] = "smollm2_eagle3",
    steps: Annotated[int, "timed batches (after one untimed)"] = 6,
    out: str = "bench_train_step.json",
) -> Report:
    """Where a drafter's training step's time goes on its experiment's own batches."""
    cfg = train_config(experiment, list(overrides))
    target, _ = load_model(cfg.model)
    datamodule = instantiate(cfg.data.module)
    datamodule.setup("fit")
    module = build_module(cfg, target)
    if not isinstance(module, FeatureLabelsModule):
        raise ValueError(
            f"the training step benchmark times drafters that read the target's features, not {module.kind}"
        )
    module.train()
    optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=1e-4)  # the step's cost, not the run's schedule
    precision = str(cfg.trainer.precision)
    bf16 = "bf16" in precision
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    batches = iter(datamodule.in_order(datamodule.train_set))
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    supervised, tokens = [], []
    rows, k = module.drafter.token_ids, module.top_k
    for step in range(steps + 1):
        batch = next(batches)
        wanted = module._wanted(batch, training=True)
        with autocast:
            read, hidden = timed(lambda: module.target_hidden(batch, module.feature_layers))  # noqa: B023
            last = hidden[..., -module.target.config.get_text_config().hidden_size :][wanted]  # [n, h]
            with torch.no_grad():  # the labels' projection with the vocabulary check, then the draft rows alone
                full, _ = timed(lambda: output_logits(module.target, last).float()[:, rows].topk(k))  # noqa: B023
                draft, _ = timed(lambda: output_logits(module.target, last, rows).float().topk(k))  # noqa: B023
            outputs = module._compute_target_outputs(batch, wanted, module.vocab_check)
            module._target_outputs = lambda *_: outputs  # noqa: B023  the drafter's part alone from here
            forward, (loss, _, accuracy, _) = timed(lambda: module._forward(batch, training=True))  # noqa: B023
            del module._target_outputs
        backward, _ = timed(lambda: (loss.backward(), optimizer.step(), optimizer.zero_grad()))  # noqa: B023
        if step:  # the first batch warms up
            for phase, ms in zip(PHASES, (read, full, draft, forward, backward), strict=True):
                times[phase].append(ms)
            supervised.append(sum(int(part[-1]) for part in accuracy))  # each step's or position's labelled rows
            tokens.append(int(batch["attention_mask"].sum()))
    medians = {phase: statistics.median(ms) for phase, ms in times.items()}
    echo = int(cfg.data.module.get("echo", 1) or 1)
    labels = medians[PHASES[1] if module.vocab_check else PHASES[2]]
    step_ms = (
        (medians["target layers"] + labels) / echo
        + medians["drafter forward"]
        + medians["drafter backward + optimizer"]
    )
    positions = statistics.median(supervised)
    # arithmetic: the target's layers over every token; the drafter's products over its rows (a forward, and about
    # twice that backward), from the multiply-adds its labelled rows and its per-row layers cost
    target_flops = 2 * linear_weights(module.target.base_model) * statistics.median(tokens)
    dtype = torch.bfloat16 if bf16 else module.target.dtype
    peak = peak_gflops(dtype)
    rate = {"target layers": target_flops / medians["target layers"] / 1e6}
    shape = f"{datamodule.batch_size} x {datamodule.max_length}"
    shown = table(
        f"one training step of {experiment}, ms (median of {steps}; batches of {shape}, {precision})",
        ["phase", "ms", "GFLOP/s", "of the peak"],
        [[phase, f"{ms:.0f}", f"{rate[phase]:.0f}" if phase in rate else "", f"{rate[phase] / peak:.0%}" if phase in rate
          else ""] for phase, ms in medians.items()],
    )  # fmt: skip
    notes = [
        f"supervised positions a step: {positions:.0f}; a step of {step_ms:.0f} ms (echo {echo}) serves "
        f"{1000 * positions / step_ms:.0f} a second",
        f"this machine's {str(dtype).removeprefix('torch.')} peak here: {peak:.0f} GFLOP/s (F.linear, 4096 x 576 x 1536)",
    ]
    overrides = [f"experiment={experiment}", *overrides]
    result = {"overrides": overrides, "kind": module.kind, "precision": precision, "batch": shape, "echo": echo,
              "median_ms": medians, "step_ms": step_ms, "supervised_positions": positions,
              "positions_per_second": 1000 * positions / step_ms, "gflops": rate, "peak_gflops": peak}  # fmt: skip
    return Report(result, [shown], notes, out=out)
