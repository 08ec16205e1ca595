"""Training-step benchmark: where an EAGLE-3 training step's time goes, on the experiment's own batches.

    python -m eval.bench_train_step                                   # the default experiment (make run's training)
    python -m eval.bench_train_step --steps 8 --out bench_train_step.json data.name=sharegpt_text_800 ...

Composes the train config with the given Hydra overrides (the data must be built already: `make run` or
`python -m train.train` builds it), then for each of `--steps` training batches (after one untimed) times, in the
run's precision: the frozen target's layers (`target_hidden`), its output projection and top-k labels with the
vocabulary check (the whole vocabulary, EAGLE-3's rule) and without it (the draft vocabulary's rows alone), the
drafter's unrolled forward, and its backward with the optimizer step. Prints the medians and writes JSON. A step with
data echoing (`data.module.echo=E`) reads the target once every E steps, so its cost is (read) / E + (drafter).
"""

import argparse
import statistics
import sys
import time

import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from rich.console import Console
from rich.table import Table

from medusa_like.apps import CONFIG_DIR
from medusa_like.config_checks import register_resolvers
from medusa_like.data.prepare import load_model
from medusa_like.io import write_json
from medusa_like.targets import output_logits
from medusa_like.training.build import build_module
from medusa_like.training.eagle3_module import Eagle3Module

PHASES = ("target layers", "output projection + top-k (vocabulary check)", "output projection + top-k (draft rows)",
          "drafter forward", "drafter backward + optimizer")  # fmt: skip


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return 1000 * (time.perf_counter() - start), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed batches (after one untimed)")
    parser.add_argument("--out", default="bench_train_step.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the train config")
    args = parser.parse_args()
    overrides = ["experiment=smollm2_eagle3", *args.overrides]
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig().set_config(cfg)
    target, _ = load_model(cfg.model)
    datamodule = instantiate(cfg.data.module)
    datamodule.setup("fit")
    module = build_module(cfg, target)
    if not isinstance(module, Eagle3Module):
        sys.exit("error: the training step benchmark times an EAGLE-3 drafter (drafter=eagle3)")
    module.train()
    optimizer = torch.optim.AdamW(module.drafter.parameters(), lr=1e-4)  # the step's cost, not the run's schedule
    precision = str(cfg.trainer.precision)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled="bf16" in precision)
    batches = iter(datamodule._loader(datamodule.train_set, shuffle=False))
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    layers = module.drafter.config.aux_layer_ids
    rows, k = module.drafter.token_ids, module.top_k
    for step in range(args.steps + 1):
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
    medians = {phase: statistics.median(ms) for phase, ms in times.items()}
    shape = f"{datamodule.batch_size} x {datamodule.max_length}"
    table = Table(title=f"one training step, ms (median of {args.steps}; batches of {shape}, {precision})")
    table.add_column("phase")
    table.add_column("ms", justify="right")
    for phase, ms in medians.items():
        table.add_row(phase, f"{ms:.0f}")
    Console(width=200).print(table)
    write_json(args.out, {"overrides": overrides, "precision": precision, "batch": shape, "median_ms": medians})


if __name__ == "__main__":
    main()
