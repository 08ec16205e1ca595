"""Table of the drafter ablations: held-out acceptance by depth and simulated chain tau of each arm, against the base.

    python -m train.train experiment=smollm2_eagle3_ablation hydra.run.dir=runs/ablation/base
    python -m train.train experiment=smollm2_eagle3_ablation hydra.run.dir=runs/ablation/tv drafter.module.loss=tv
    python -m eval.ablations runs/ablation [--base base]     # ablations.json and the table

Each arm is a run directory under the given folder holding `metrics.json` (what `train` writes at its end) and
`.hydra/overrides.yaml` (the command line's overrides, the arm's only difference from the base besides its
directory). Arms trained the same steps on the same batches from the same target cache, so their held-out top-1 by
depth compares like with like; the table gives each arm's change against the base arm.
"""

import argparse
import json
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from medusa_like.io import write_json

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="the folder holding one run directory per arm")
    parser.add_argument("--base", default="base", help="the arm the others are compared with")
    args = parser.parse_args()
    arms = [arm(d) for d in sorted(args.root.iterdir()) if (d / "metrics.json").is_file()]
    base = next((a for a in arms if a["name"] == args.base), None)
    if base is None:
        raise SystemExit(f"error: {args.root / args.base}: no finished base arm (metrics.json)")
    table = Table(title=f"held-out acceptance per arm ({args.root})")
    for column in ("arm", "overrides", *(f"top-1 d{d}" for d in DEPTHS), "sim tau (chain)", "vs base"):
        table.add_column(column)
    for a in [base, *(a for a in arms if a is not base)]:
        a["delta_sim_tau"] = a["sim_tau_chain"] - base["sim_tau_chain"]
        a["delta_top1_d1"] = a["top1"][0] - base["top1"][0]
        table.add_row(
            a["name"],
            " ".join(a["overrides"]) or "-",
            *("-" if x is None else f"{x:.3f}" for x in a["top1"]),  # fewer unrolled steps: no deeper depths
            f"{a['sim_tau_chain']:.3f}",
            "-" if a is base else f"{a['delta_sim_tau']:+.3f} tau, {a['delta_top1_d1']:+.3f} d1",
        )
    Console(width=200).print(table)
    write_json(args.root / "ablations.json", {"base": args.base, "arms": arms})


if __name__ == "__main__":
    main()
