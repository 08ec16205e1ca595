"""Agreement of two evaluations' outputs: each method of one run against a reference method of another, prompt by
prompt, on the same prompts (e.g. a bf16 target's methods against fp32 greedy).

    python -m eval.evaluate ... hydra.run.dir=runs/make_run/eval                        # fp32 (the default)
    python -m eval.evaluate ... model.dtype=bfloat16 hydra.run.dir=runs/make_run/eval_bf16
    python -m eval.bench agreement runs/make_run/eval runs/make_run/eval_bf16          # against the first's (a)

Reads each run's `prompts.jsonl` (every prompt's ids and every method's new tokens, as the evaluation writes it). A
prompt is matched by its question, turn and prompt ids; runs over other prompts are refused. For each method of the
second run: how many outputs equal the reference's, and where the others first differ (the token index).
"""

import json
from pathlib import Path
from typing import Annotated

from medusa_like.evaluation.metrics import first_divergence

from .harness import Report, table

PROMPTS = "prompts.jsonl"  # what an evaluation run directory holds per prompt (evaluation/prompt_loop.py)


def outputs(run: Path) -> dict[tuple, dict]:
    """{(question_id, turn): record} of an evaluation run directory's prompts."""
    path = Path(run) / PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {PROMPTS} (not an evaluation run directory, or a run not finished)")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {(r["question_id"], r["turn"]): r for r in records}


def run(
    reference_run: Annotated[Path, "the evaluation run directory whose method is the reference"],
    other_run: Annotated[Path, "the evaluation run directory whose methods are compared with it"],
    *,
    reference: Annotated[str, "the reference run's method"] = "hf_greedy",
    out: str = "agreement.json",
) -> Report:
    """Each method of `other_run` against `reference` of `reference_run`, prompt by prompt."""
    base, other = outputs(reference_run), outputs(other_run)
    if not base:
        raise ValueError(f"{reference_run}: {PROMPTS} holds no prompt")
    if set(base) != set(other) or any(base[k]["prompt_ids"] != other[k]["prompt_ids"] for k in base):
        raise ValueError(f"{reference_run} and {other_run} were evaluated on other prompts: nothing to compare")
    if any(reference not in record for record in base.values()):
        raise ValueError(f"{reference_run}: method {reference!r} did not run on every prompt")
    methods = [m for m, v in next(iter(other.values())).items() if isinstance(v, dict) and "tokens" in v]
    result = {"reference_run": str(reference_run), "other_run": str(other_run), "reference": reference, "methods": {}}
    rows = []
    for method in methods:
        firsts = [
            first_divergence(other[k][method]["tokens"], base[k][reference]["tokens"])
            for k in sorted(base)
            if method in other[k]
        ]
        differing = sorted(i for i in firsts if i is not None)
        result["methods"][method] = {"prompts": len(firsts), "equal": len(firsts) - len(differing), "first": differing}
        rows.append([method, f"{len(firsts) - len(differing)} / {len(firsts)}", ", ".join(map(str, differing)) or "-"])
    title = f"outputs of {other_run} equal to {reference} of {reference_run}"
    return Report(result, [table(title, ["method", "equal", "first differences at token"], rows)], out=out)
