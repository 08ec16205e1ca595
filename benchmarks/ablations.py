"""Table of the drafter ablations: held-out acceptance by depth and simulated chain tau of each arm, against the base.

    python -m train.train experiment=smollm2_eagle3_ablation hydra.run.dir=runs/ablation/base
    python -m train.train experiment=smollm2_eagle3_ablation hydra.run.dir=runs/ablation/tv drafter.module.loss=tv
    python -m eval.bench ablations runs/ablation [--base base]     # ablations.json and the table

Each arm is a run directory under the given folder holding `metrics.json` (what `train` writes at its end) and
`.hydra/overrides.yaml` (the command line's overrides, the arm's only difference from the base besides its
directory). Arms trained the same steps on the same batches from the same target cache, so their held-out top-1 by
depth compares like with like; the table gives each arm's change against the base arm.
"""

import json
from pathlib import Path
from typing import Annotated

import yaml

from .harness import Report, table

DEPTHS = (1, 2, 3, 4)


def arm(directory: Path) -> dict:
    """{name, overrides, top1 by depth, sim_tau} of one finished arm."""
    metrics = json.loads((directory / "metrics.json").read_text())
    overrides_file = directory / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
    kept = [o for o in overrides if not o.startswith(("hydra.", "experiment=", "logger="))]
    return {
        "name": directory.name,
        "overrides": kept,
        "top1": [metrics.get(f"val/acc_top1_depth{d}") for d in DEPTHS],
        "sim_tau_chain": metrics.get("val/sim_tau_chain"),
    }


def run(
    root: Annotated[Path, "the folder holding one run directory per arm"],
    *,
    base: Annotated[str, "the arm the others are compared with"] = "base",
) -> Report:
    """Held-out acceptance by depth and simulated chain tau of each ablation arm, against the base arm."""
    root = Path(root)
    arms = [arm(d) for d in sorted(root.iterdir()) if (d / "metrics.json").is_file()]
    base_arm = next((a for a in arms if a["name"] == base), None)
    if base_arm is None:
        raise FileNotFoundError(f"{root / base}: no finished base arm (metrics.json)")
    rows = []
    for a in [base_arm, *(a for a in arms if a is not base_arm)]:
        a["delta_sim_tau"] = a["sim_tau_chain"] - base_arm["sim_tau_chain"]
        a["delta_top1_d1"] = a["top1"][0] - base_arm["top1"][0]
        rows.append(
            [
                a["name"],
                " ".join(a["overrides"]) or "-",
                *("-" if x is None else f"{x:.3f}" for x in a["top1"]),  # fewer unrolled steps: no deeper depths
                f"{a['sim_tau_chain']:.3f}",
                "-" if a is base_arm else f"{a['delta_sim_tau']:+.3f} tau, {a['delta_top1_d1']:+.3f} d1",
            ]
        )
    columns = ["arm", "overrides", *(f"top-1 d{d}" for d in DEPTHS), "sim tau (chain)", "vs base"]
    shown = table(f"held-out acceptance per arm ({root})", columns, rows)
    return Report({"base": base, "arms": arms}, [shown], out=root / "ablations.json")
