"""The evaluation itself catches a decoding method that is not lossless: it reports the mismatch with the target's
logit margin at the first difference and exits nonzero. In a lower precision it sets aside only the differences from
transformers' greedy that the two forwards' rounding explains.

The decoding loop is exact whatever a drafter proposes, so a lossy method is made here the way a bug would make one: a
method whose output is the real speculative output with one token changed. Everything else (the timing, the
comparison with transformers' greedy output, the margins, the report and the exit code) is the evaluation's own.
"""

import json
import math

import pytest
import torch

from eval.evaluate import evaluate, exit_code
from medusa_like.drafters.lookup import LookupDrafter
from medusa_like.evaluation.losslessness import TIE_ULPS, losslessness_section, rounding_differences, within_rounding
from medusa_like.evaluation.methods import METHODS, REFERENCE, SPECULATIVE, STOCK, Method
from medusa_like.model import MedusaLikeModel

from .conftest import flat_cost, random_prompts, stock_greedy, tiny_target, untouched_target

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
]
CHANGED_AT = 3  # the token of every speculative output the lossy method changes


def lossy(method: Method) -> Method:
    def make(context):
        run = method.make(context)

        def run_lossy(ids, max_new_tokens):
            tokens, stats = run(ids, max_new_tokens)
            tokens = list(tokens)
            tokens[CHANGED_AT] = (tokens[CHANGED_AT] + 1) % context.model.target.config.vocab_size
            return tokens, stats

        return run_lossy

    return Method(method.label, method.description, make, method.applies)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_the_evaluation_reports_a_lossy_method_and_fails(tmp_path, eval_cfg, monkeypatch, broken):
    if broken:
        monkeypatch.setitem(METHODS, SPECULATIVE, lossy(METHODS[SPECULATIVE]))
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    cfg = eval_cfg(
        f"data.path={questions}",
        "drafter.mode=learned",
        "tree=chain",
        "eval.max_new_tokens=8",
        "eval.sweep.prompts=0",
        "eval.head_accuracy=false",
        "eval.warmup=false",
        "eval.methods=[hf_greedy,speculative]",
        f"out_dir={tmp_path / 'run'}",
    )
    report = evaluate(cfg)
    lossless = report["losslessness"]
    if not broken:
        assert lossless["fraction"] == 1.0 and exit_code(report, fail_on_mismatch=True) == 0
        return
    assert lossless["fraction"] == 0.0 and not report["summary"]["lossless"]
    assert [m["first_divergence"] for m in lossless["mismatched"]] == [CHANGED_AT] * len(QUESTIONS)
    # the target's own greedy token beats the changed one: a positive margin, not a near-tie
    assert all(m["margin"] > 0 for m in lossless["mismatched"])
    assert exit_code(report, fail_on_mismatch=True) == 1
    assert "LOSSLESSNESS FAILED" in (tmp_path / "run" / "report.md").read_text()


def difference(method, question, margin, logit=16.0):
    return {"method": method, "question_id": question, "turn": 1, "first_divergence": 5, "margin": margin,
            "reference_logit": logit}  # fmt: skip


def test_a_lower_precision_sets_aside_only_rounding_differences_of_methods_that_follow_greedy_on_their_forward():
    """In bf16, (g)'s differences are set aside where the method equals (a) on that prompt and (g)'s margin is within
    TIE_ULPS units in the last place at its logit (bf16 at 16: 0.125 a unit), for this project's methods; never in
    fp32, never past the bound, never where the method also differs from (a)."""
    stock = [
        difference(SPECULATIVE, "tie", -0.25),  # 2 units: rounding
        difference(SPECULATIVE, "wide", 1.5),  # 12 units: a bug
        difference(SPECULATIVE, "own", 0.125),  # within the bound, but it differs from (a) too
        difference(SPECULATIVE, "unknown", None),  # an EOS decided differently: no margin
        difference(SPECULATIVE, "small logit", 0.25, logit=1.5),  # 32 units at 1.5
        difference("hf_prompt_lookup", "tie", -0.25),  # a baseline's: not this project's to set aside
    ]
    differences = {REFERENCE: [difference(SPECULATIVE, "own", 0.125)], STOCK: stock}
    assert rounding_differences(differences, torch.bfloat16, [SPECULATIVE]) == [stock[0]]
    assert rounding_differences(differences, torch.float32, [SPECULATIVE]) == []
    assert within_rounding(difference(SPECULATIVE, "q", TIE_ULPS * 0.125), torch.bfloat16)
    assert not within_rounding(difference(SPECULATIVE, "q", TIE_ULPS * 0.125 + 0.01), torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------------
# The tie window (TIE_ULPS) measured on real forwards, and a forward off by more than it failing


BF16_SHAPE = dict(hidden_size=64, intermediate_size=128)


def bf16_model(family: str) -> MedusaLikeModel:
    """A tiny bf16 target on this project's eager bf16 step (few-row layers, the row-invariant attention where they
    build), plain decoding only."""
    target = tiny_target(family, **BF16_SHAPE).to(torch.bfloat16)
    model = MedusaLikeModel(target, None, LookupDrafter())
    model.drafter.use_cost_model(flat_cost(model.target))
    return model


def records_of(prompts, ours: list[list[int]], stock: list[list[int]]) -> list[dict]:
    """Evaluation records of greedy on the same forward (a), transformers' greedy as it ships (g) and a method of this
    project that equals (a), as the evaluation's prompt loop writes them."""
    return [
        {"question_id": i, "turn": 1, "prompt_ids": prompt[0].tolist(), REFERENCE: {"tokens": a, "stats": None},
         STOCK: {"tokens": g, "stats": None}, SPECULATIVE: {"tokens": a, "stats": {}}}
        for i, (prompt, a, g) in enumerate(zip(prompts, ours, stock, strict=True))
    ]  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_bf16_forwards_of_the_same_weights_differ_within_the_tie_window_and_a_wrong_one_beyond_it(family):
    """The window measured here as on the default target (docs/results.md at b889c96: up to 6 units over 160 MT-Bench
    prompts): greedy on this project's bf16 step and transformers' own bf16 greedy of the same weights differ on some of
    24 prompts, each first difference a near-tie within TIE_ULPS units at (g)'s logit, so the evaluation sets them aside
    and the run is lossless. A forward off by more than the window (its greedy, and so the method's, taking at one
    position the token that (g)'s logits put below by more than TIE_ULPS units) fails the run, though the method equals
    greedy on its own forward."""
    model = bf16_model(family)
    stock = untouched_target(family, dtype=torch.bfloat16, **BF16_SHAPE)  # (g) of an untouched copy: transformers' own
    prompts = random_prompts(24, seed=13, min_len=8, max_len=60)
    ours = [model.generate(p, max_new_tokens=32, tree="none", eos_token_id=[]).new_tokens.tolist() for p in prompts]
    theirs = stock_greedy(stock, prompts, 32)
    methods = [REFERENCE, STOCK, SPECULATIVE]
    section = losslessness_section(model, records_of(prompts, ours, theirs), methods)
    rounding = section["differences"][STOCK]
    assert rounding, "no difference between the two bf16 forwards: the window was not measured"
    ulps = [abs(d["margin"]) / ulp_at(d["reference_logit"]) for d in rounding if d["method"] == SPECULATIVE]
    assert max(ulps) <= TIE_ULPS, f"rounding differences of up to {max(ulps):.1f} units, beyond {TIE_ULPS}"
    assert section["lossless"] and len(section["set_aside"]) == len(ulps)

    # a wrong forward: at the position of each prompt where (g) is surest, its runner-up token instead
    wrong = []
    with torch.no_grad():
        for prompt, g in zip(prompts, theirs, strict=True):
            logits = stock(torch.cat([prompt[0], torch.tensor(g)])[None]).logits[0, prompt.shape[1] - 1 : -1].float()
            top = logits.topk(2, dim=-1)  # [T, 2]
            k = int((top.values[:, 0] - top.values[:, 1]).argmax())
            wrong.append([*g[:k], int(top.indices[k, 1]), *g[k + 1 :]])
    section = losslessness_section(model, records_of(prompts, wrong, theirs), methods)
    assert not section["lossless"] and section["set_aside"] == []
    failed = {f["reference"]: f for f in section["failures"] if f["method"] == SPECULATIVE}
    assert set(failed) == {STOCK} and failed[STOCK]["differing_prompts"] == len(prompts)
    margins = [d for d in section["differences"][STOCK] if d["method"] == SPECULATIVE]
    assert all(abs(d["margin"]) > TIE_ULPS * ulp_at(d["reference_logit"]) for d in margins)


def ulp_at(logit: float) -> float:
    """bf16's unit in the last place at `logit` (as `within_rounding` counts it)."""
    info = torch.finfo(torch.bfloat16)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(logit), info.tiny)))
