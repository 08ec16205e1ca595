"""The report's margin to fp32 greedy: where the target verifies in another precision (bf16), every method's outputs
against greedy decoding of the same weights in fp32, by transformers as it ships.

Losslessness is asserted against greedy in the run's own precision, (a): that is what speculative decoding promises.
This section says what the precision itself costs: how many prompts still give fp32 greedy's tokens, how many tokens
each output follows it for, and fp32's logit margin at the first difference (near zero: a near-tie the lower
precision flipped; large: the precision changed the answer). It does not change the exit status.

    if wanted(cfg.eval.fp32_reference, model.target.dtype):        # auto: wherever the run is not fp32
        section = fp32_margin_section(cfg.model, model, records, methods, cfg.eval.max_new_tokens)
"""

import logging
import statistics

import torch
from tqdm import tqdm

from medusa_like.data.prepare import load_model
from medusa_like.evaluation.losslessness import compare
from medusa_like.evaluation.methods import hf_runner

log = logging.getLogger(__name__)

FP32_GREEDY = "fp32_greedy"  # the reference's name in this section (not a timed method)


def check_setting(value) -> None:
    if not (value == "auto" or isinstance(value, bool)):
        raise ValueError(f"must be auto, true or false, got {value!r}")


def wanted(setting, dtype: torch.dtype) -> bool:
    """Whether a run in `dtype` compares its outputs with fp32 greedy under `eval.fp32_reference` = `setting`."""
    check_setting(setting)
    return dtype != torch.float32 if setting == "auto" else bool(setting)


@torch.inference_mode()
def fp32_greedy_tokens(target, model, records: list[dict], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of each record's prompt by `target` (fp32, transformers' `generate`), with the evaluated
    model's EOS and pad ids: what (a) would give in fp32."""
    eos = model.eos_token_ids()
    pad = model.tokenizer.pad_token_id
    run = hf_runner(target, eos, pad if pad is not None else (eos[0] if eos else None))
    device = target.device
    return [
        run(torch.tensor([r["prompt_ids"]], device=device), max_new_tokens)[0]
        for r in tqdm(records, desc="fp32 greedy", unit="prompt")
    ]


def fp32_margin_section(model_cfg, model, records: list[dict], methods: list[str], max_new_tokens: int) -> dict:
    """Every method of `methods` against fp32 greedy of the same weights (`model_cfg` loaded again in fp32): its
    share of equal outputs, the tokens each differing output follows fp32 greedy for (median), and the fp32 logit
    margins at the first differences; where the fp32 copy does not fit in memory, why not (`skipped`), and the
    report is written without it."""
    try:
        target, _ = load_model(model_cfg, dtype="float32")
        tokens = fp32_greedy_tokens(target, model, records, max_new_tokens)
    except (torch.OutOfMemoryError, MemoryError) as err:  # a second, fp32 copy of a large target: the report stays
        why = f"the fp32 copy of the target did not fit ({type(err).__name__}); eval.fp32_reference=false skips it"
        log.warning("no margin to fp32 greedy: %s", why)
        return {"dtype": str(model.target.dtype), "skipped": why}
    with_reference = [{**r, FP32_GREEDY: {"tokens": t}} for r, t in zip(records, tokens, strict=True)]
    result = compare(target, with_reference, [*methods, FP32_GREEDY], FP32_GREEDY)
    per_method = {}
    for m in methods:
        differences = [d for d in result["differences"] if d["method"] == m]
        margins = [abs(d["margin"]) for d in differences if d.get("margin") is not None]
        per_method[m] = {
            "equal": result["shares"][m],
            "differing_prompts": len(differences),
            "median_tokens_followed": statistics.median(d["first_divergence"] for d in differences)
            if differences
            else None,
            "median_abs_margin": statistics.median(margins) if margins else None,
        }
    return {
        "dtype": str(model.target.dtype),
        "reference": "transformers' greedy as it ships, the same weights loaded in fp32",
        "prompts": len(records),
        "per_method": per_method,
        "differences": result["differences"],
    }
