"""The evaluation itself catches a decoding method that is not lossless: it reports the mismatch with the target's
logit margin at the first difference and exits nonzero. In a lower precision it sets aside only the differences from
transformers' greedy that the two forwards' rounding explains.

The decoding loop is exact whatever a drafter proposes, so a lossy method is made here the way a bug would make one: a
method whose output is the real speculative output with one token changed. Everything else (the timing, the
comparison with transformers' greedy output, the margins, the report and the exit code) is the evaluation's own.
"""

import json

import pytest
import torch

from eval.evaluate import evaluate, exit_code
from medusa_like.evaluation.losslessness import TIE_ULPS, rounding_differences, within_rounding
from medusa_like.evaluation.methods import METHODS, REFERENCE, SPECULATIVE, STOCK, Method

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
