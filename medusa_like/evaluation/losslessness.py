"""The report's losslessness section: every method's outputs against greedy on the same forward, (a), and against
transformers' greedy as it ships, (g), with the logit margin at each first differing token. Its `lossless` is what
the evaluation's exit status follows.

In fp32 both are required. In a lower precision (bf16) two forwards of the same weights round apart enough to flip
near-ties, so greedy on the same forward is the reference ("that precision's own greedy"): a method's difference from
(g) is set aside, listed but not a failure, only where the method equals (a) on that prompt and (g)'s logit margin
there is within `TIE_ULPS` units in the last place of the dtype at that logit's size (a bug shows larger margins).
"""

import math

import torch

from medusa_like.evaluation import metrics
from medusa_like.evaluation.methods import REFERENCE, SPECULATIVE, STOCK

# a lower precision's rounding: (g)'s margin within this many of its units in the last place at the logit. The bound is
# measured: two bf16 forwards of the default target (ours and transformers' stock layers) differed by up to 6 at the
# first differing token of 160 MT-Bench prompts (docs/results.md at b889c96), those of tiny bf16 targets by up to 1
# (checked by tests/test_eval_mismatch.py, which also fails a forward whose token (g) puts lower by more than this); 8
# keeps 2 of headroom over the widest measured. At a logit near 16 a bf16 unit is 0.125, so 8 forgive a margin of 1: a
# wrong forward's first difference is wider (whole logits), as the same test's is
TIE_ULPS = 8
LOSSLESSNESS = (
    "share of prompts whose speculative tokens equal (a)'s, greedy on the same forward: "
    "same length, equal token for token; lossless: every method of this project equals (a), and (g) wherever (g) ran, "
    "on every prompt (what the exit status follows); in a lower precision than fp32, (g)'s differences that its "
    "rounding explains are set aside (`set_aside`)"
)


def our_methods(records: list[dict], methods: list[str]) -> list[str]:
    """This project's decoding methods among `methods` (those with decoding stats); the baselines report none."""
    return [m for m in methods if records[0][m]["stats"] is not None]


def losslessness_section(model, records: list[dict], methods: list[str]) -> dict:
    """Every method's outputs against greedy on the same forward, (a), and against transformers'
    greedy as it ships, (g): equality shares and, for each difference, the logit margin at the first differing token.

    The headline fields (`fraction`, `mismatches`, `mismatched`) are the speculative method's against (a). `failures`
    lists each method of this project that differs from (a), or from (g) where (g) ran, with its margins; `lossless`
    (no failure) is what the exit status follows: the claim is equality with both."""
    section = metrics.losslessness([(r[SPECULATIVE]["tokens"], r[REFERENCE]["tokens"]) for r in records])
    del section["mismatch_index"], section["first_divergence"]
    against = {REFERENCE: compare(model.target, records, methods, REFERENCE)}
    stock = stock_note(model, methods)
    if stock["compared"]:
        against[STOCK] = compare(model.forward.stock(), records, methods, STOCK)
    differences = {ref: result["differences"] for ref, result in against.items()}
    section["mismatched"] = [d for d in differences[REFERENCE] if d["method"] == SPECULATIVE]
    ours = our_methods(records, methods)
    section["per_method"] = {m: against[REFERENCE]["shares"][m] for m in ours}  # equality with (a)
    dtype = next(model.target.parameters()).dtype
    section["set_aside"] = [] if STOCK not in against else rounding_differences(differences, dtype, ours)
    if section["set_aside"]:
        stock["note"] += (
            f"; in {str(dtype).removeprefix('torch.')}, {len(section['set_aside'])} difference(s) from (g) of methods "
            f"equal to (a) on that prompt, each within {TIE_ULPS} units in the last place of the dtype at (g)'s "
            "logit, are the two forwards' rounding (greedy on the same forward is this precision's reference): "
            "listed below, not failures"
        )
    gated = {
        ref: {"differences": [d for d in found if d not in section["set_aside"]]} for ref, found in differences.items()
    }
    section["failures"] = failures(ours, gated, len(records))
    section["not_lossless"] = [m for m in ours if any(f["method"] == m for f in section["failures"])]
    section["lossless"] = not section["failures"]
    section["equality"] = {
        m: {ref: result["shares"].get(m) for ref, result in against.items() if ref != m} for m in methods
    }
    section["differences"] = differences
    section["stock"] = stock
    section["definition"] = LOSSLESSNESS
    return section


def rounding_differences(differences: dict[str, list[dict]], dtype: torch.dtype, ours: list[str]) -> list[dict]:
    """The differences from (g) (`differences[STOCK]`) of this project's methods (`ours`) that a lower precision's
    rounding explains: the method equals (a) on that prompt and (g)'s margin is within `TIE_ULPS` units in the last
    place of `dtype` at its logit. None in fp32 (or wider), where (g) is required."""
    if torch.finfo(dtype).bits >= 32:
        return []
    own = {(d["method"], d["question_id"], d["turn"]) for d in differences[REFERENCE]}
    return [
        d
        for d in differences[STOCK]
        if d["method"] in ours and (d["method"], d["question_id"], d["turn"]) not in own and within_rounding(d, dtype)
    ]


def within_rounding(difference: dict, dtype: torch.dtype) -> bool:
    """Whether a difference's margin is within `TIE_ULPS` units in the last place of `dtype` at the reference's
    logit (False where either is unknown)."""
    margin, logit = difference.get("margin"), difference.get("reference_logit")
    if margin is None or logit is None:
        return False
    info = torch.finfo(dtype)
    ulp = info.eps * 2.0 ** math.floor(math.log2(max(abs(logit), info.tiny)))
    return abs(margin) <= TIE_ULPS * ulp


def failures(ours: list[str], against: dict[str, dict], prompts: int) -> list[dict]:
    """One entry per method of this project (`ours`) and reference of `against` ({reference: `compare`'s result})
    whose outputs differ on some prompt: how many of the `prompts` differ, and the reference's logit margin at each
    first difference (None where one output ends where the other goes on)."""
    found = []
    for reference, result in against.items():
        for method in ours:
            differences = [d for d in result["differences"] if d["method"] == method]
            if differences:
                found.append(
                    {
                        "method": method,
                        "reference": reference,
                        "differing_prompts": len(differences),
                        "prompts": prompts,
                        "margins": [d.get("margin") for d in differences],
                    }
                )
    return found


def stock_note(model, methods: list[str]) -> dict:
    """Whether (g), transformers' greedy with its own nn.Linear layers, was run and compared, and why not."""
    if STOCK in methods:
        return {"compared": True, "note": "every method compared with (g) as well as with (a)"}
    if not model.forward.differs_from_stock:
        note = (
            "(g) not run: the target runs eagerly on its own nn.Linear layers (no tuned layers on this device and "
            "dtype, nothing compiled), so (a) is transformers' greedy as it ships"
        )
    else:
        note = "(g) not run in this run's records: outputs are compared with (a), greedy on the same forward, alone"
    return {"compared": False, "note": note}


def compare(target, records: list[dict], methods: list[str], reference: str) -> dict:
    """Every method but `reference` against `reference`'s tokens: {"shares": {method: share of equal outputs},
    "differences": one entry per differing output, with `target`'s logit margin at its first differing token}.
    The margins are computed after the timed runs, with one forward of `target` per prompt that has a difference."""
    others = [m for m in methods if m != reference]
    shares = {
        m: metrics.losslessness([(r[m]["tokens"], r[reference]["tokens"]) for r in records])["fraction"] for m in others
    }
    differences = []
    for record in records:
        diverging = {m: metrics.first_divergence(record[m]["tokens"], record[reference]["tokens"]) for m in others}
        diverging = {m: d for m, d in diverging.items() if d is not None}
        if not diverging:
            continue
        margins = divergence_margins(target, record, reference, diverging)
        for m, index in diverging.items():
            differences.append(
                {
                    "method": m,
                    "question_id": record["question_id"],
                    "turn": record["turn"],
                    "first_divergence": index,
                    **margins[m],
                }
            )
    return {"shares": shares, "differences": differences}


@torch.inference_mode()
def divergence_margins(target, record: dict, reference: str, diverging: dict[str, int]) -> dict[str, dict]:
    """Per method of `diverging` ({method: first differing index}): `target`'s logits after the prompt and the
    reference's tokens up to that index, the two tokens there, and the margin: the reference's token's logit minus
    the method's (near zero: a near-tie that rounding can flip; large: a bug). One forward over the prompt and the
    reference's answer, keeping the logits of the positions asked for."""
    ref_tokens = record[reference]["tokens"]
    out: dict[str, dict] = {}
    scored = {}
    for m, index in diverging.items():
        if index >= len(ref_tokens) or index >= len(record[m]["tokens"]):
            out[m] = {"margin": None, "note": "one output ends where the other goes on (an EOS decided differently)"}
        else:
            scored[m] = index
    if scored:
        prompt = record["prompt_ids"]
        ids = torch.tensor([prompt + ref_tokens[: max(scored.values())]], device=target.device)
        positions = sorted(set(scored.values()))
        keep = torch.tensor([len(prompt) + i - 1 for i in positions], device=target.device)
        logits = target(ids, logits_to_keep=keep).logits[0].float()  # [len(positions), V]
        for m, index in scored.items():
            row = logits[positions.index(index)]
            ours = record[m]["tokens"][index]
            out[m] = {
                "reference_token": ref_tokens[index],
                "method_token": ours,
                "margin": float(row[ref_tokens[index]] - row[ours]),
                "reference_logit": float(row[ref_tokens[index]]),
            }
    return out
