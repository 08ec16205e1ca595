"""The evaluation app on a tiny random Llama (the default's tokenizer and chat template): every report field and plot,
losslessness 1.0, the loud failure path, the question sets, and a clear error for each bad input."""

import json
import re
from pathlib import Path

import pytest
import torch

from eval.evaluate import evaluate, exit_code
from medusa_like.data.prepare import load_model as load_target
from medusa_like.data.split import is_validation
from medusa_like.drafters.base import DrafterMismatchError
from medusa_like.drafters.medusa import HeadsConfig, MedusaHeads
from medusa_like.evaluation import precision
from medusa_like.evaluation.lossless_report import failure_line
from medusa_like.evaluation.plots import PLOTS
from medusa_like.evaluation.precision import fp32_margin_section
from medusa_like.evaluation.questions import (
    QuestionSetError,
    load_humaneval_questions,
    load_jsonl_questions,
    load_validation_questions,
)
from medusa_like.evaluation.report import markdown
from medusa_like.evaluation.setup import load_eval_model as load_model
from medusa_like.evaluation.setup import question_set
from medusa_like.formats import save_drafter
from medusa_like.targets import eos_token_ids
from medusa_like.tiny import tiny_chat_target

from .conftest import compose_config

# a drafter alone: no (e), (f); (g) since a tiny fp32 target on the CPU gets few-row layers
LEARNED_METHODS = {"hf_greedy", "hf_prompt_lookup", "hf_greedy_stock", "plain_loop", "speculative"}
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it about snow."]},
    {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    questions = write_jsonl(tmp / "questions.jsonl", QUESTIONS)
    cfg = compose_config(  # not the eval_cfg fixture: composed once for the module's tests
        "eval",
        tmp / "hydra",
        "model=tiny_llama",
        "drafter.mode=learned",  # the zero-initialised heads alone: static trees, head accuracy
        f"data.path={questions}",
        "eval.max_new_tokens=8",
        "eval.sweep.budgets=[0,2,4]",
        "eval.sweep.prompts=1",
        f"out_dir={tmp / 'run'}",
        "tree=auto",  # the tree search first: calibrate on the same file, time budgets 1 and 2, keep the fastest
        "tree_search.calibration.source=jsonl",
        f"tree_search.calibration.path={questions}",
        "tree_search.budgets=[1,2]",
        "tree_search.timing_prompts=1",
    )
    return evaluate(cfg), tmp / "run"


@pytest.mark.slow
def test_report_fields(report):
    report, run = report
    summary = report["summary"]
    for key in ("tau", "mean_accepted_draft", "speedup_vs_hf_greedy", "speedup_vs_hf_prompt_lookup", "losslessness"):
        assert isinstance(summary[key], float)
    assert report["setup"]["data"]["questions"] == 2
    assert report["setup"]["step"].startswith("eager step, ")  # the fixture asks for the eager step (conftest.py)
    acc = report["acceptance"]
    assert acc["prompts"] == 3  # two turns + one turn
    steps, prompts = acc["tree_steps"], acc["prompts"]
    drafted = sum(i * n for i, n in enumerate(acc["histogram"]))  # histogram[i]: steps that accepted i drafts
    assert acc["target_forwards"] == steps + prompts  # one prefill per prompt, one verification per step
    assert acc["new_tokens"] == 8 * prompts <= prompts + steps + drafted  # eval.max_new_tokens=8 cuts the last step
    assert acc["tau"] == pytest.approx(acc["new_tokens"] / acc["target_forwards"]) and acc["tau"] > 1.0
    assert sum(acc["histogram"]) == acc["tree_steps"]
    assert set(acc["per_category"]) == {"writing", "math"}
    assert acc["per_category"]["writing"]["prompts"] == 2
    assert list(report["head_accuracy"]) == ["head1", "head2", "head3", "head4"]
    assert list(report["head_accuracy"]["head1"]) == [f"top{k}" for k in range(1, 11)]
    assert set(report["speed"]["median_tokens_per_second"]) == LEARNED_METHODS
    assert set(report["speed"]["speedup"]) == {"hf_greedy", "hf_prompt_lookup"}
    assert [r["budget"] for r in report["tree_sweep"]] == [0, 2, 4]
    assert report["tree_sweep"][0]["tau"] == 1.0
    assert report["tree_search"]["label"] in (1, 2)
    assert report["setup"]["tree"]["nodes"] == report["tree_search"]["label"] + 1
    # tree=auto: the search's tree and machine profile, each a file of the run directory; the report names the profile
    assert report["tree_search"]["path"] == str(run / "tree.json")
    assert report["setup"]["profile"]["path"] == report["tree_search"]["profile"] == str(run / "profile.json")
    assert [(p["question_id"], p["turn"]) for p in report["prompts"]] == [("1", 1), ("1", 2), ("2", 1)]
    assert all(set(p["new_tokens"]) == LEARNED_METHODS for p in report["prompts"])
    assert set(report["definitions"]) >= {"tau", "mean_accepted_draft", "speedup", "losslessness"}


@pytest.mark.slow
def test_lossless_on_fp32(report):
    report, _ = report
    assert report["losslessness"]["fraction"] == 1.0
    assert report["losslessness"]["mismatched"] == []
    assert all(p["match"] for p in report["prompts"])
    # every method produced the same number of tokens as the reference
    assert all(len(set(p["new_tokens"].values())) == 1 for p in report["prompts"])


@pytest.mark.slow
def test_files_written(report):
    report, run = report
    on_disk = json.loads((run / "report.json").read_text())
    assert on_disk["summary"] == report["summary"]
    md = (run / "report.md").read_text()
    assert md.startswith("# Evaluation report") and "CAUTION" not in md
    for name in PLOTS.values():
        assert (run / name).stat().st_size > 1000
        assert f"]({name})" in md


@pytest.mark.slow
def test_mismatch_is_loud(report):
    report, _ = report
    assert report["losslessness"]["failures"] == [] and failure_line(report) is None
    bad = json.loads(json.dumps(report))
    difference = {"method": "speculative", "question_id": "1", "turn": 2, "first_divergence": 3, "margin": 0.25}
    bad["losslessness"].update(
        fraction=0.5,
        mismatches=1,
        mismatched=[difference],
        differences={"hf_greedy": [difference], "hf_greedy_stock": []},
        failures=[
            {"method": "speculative", "reference": "hf_greedy", "differing_prompts": 1, "prompts": 3, "margins": [0.25]}
        ],
    )
    bad["summary"].update(losslessness=0.5, lossless=False)
    md = markdown(bad)
    assert md.startswith("> [!CAUTION]") and "LOSSLESSNESS FAILED" in md.splitlines()[1]
    assert "`speculative` 1/turn 2 at token 3 against `hf_greedy`" in md
    expected = "not lossless: speculative differs from hf_greedy on 1 of 3 prompts (margins 0.25 to 0.25)"
    assert failure_line(bad) == expected
    assert exit_code(bad, fail_on_mismatch=True) == 1
    assert exit_code(bad, fail_on_mismatch=False) == 0
    assert exit_code(report, fail_on_mismatch=True) == 0


# ---------------------------------------------------------------------------------------------------------------------
# Question sets


def test_jsonl_questions(tmp_path):
    qs = load_jsonl_questions(write_jsonl(tmp_path / "q.jsonl", [*QUESTIONS, ""]))
    assert [(q.question_id, q.category, len(q.turns)) for q in qs] == [("1", "writing", 2), ("2", "math", 1)]


def test_humaneval_questions():
    qs = load_humaneval_questions()
    assert len(qs) == 164 and qs[0].question_id == "HumanEval/0" and qs[0].category == "humaneval"
    assert "def has_close_elements" in qs[0].turns[0]


def test_validation_questions_follow_the_training_split(tmp_path):
    from medusa_like.data.split import is_validation

    convs = [
        {
            "id": f"c{i}",
            "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "a"}],
        }
        for i in range(40)
    ]
    path = write_jsonl(tmp_path / "convs.jsonl", convs)
    qs = load_validation_questions(str(path), val_fraction=0.3, split_seed=0)
    expected = [f"c{i}" for i in range(40) if is_validation(f"c{i}", 0.3, 0)]
    assert [q.question_id for q in qs] == expected and expected
    assert qs[0].turns == (f"question {expected[0][1:]}",)


@pytest.mark.slow
def test_per_category_subset(tmp_path, eval_cfg):
    path = write_jsonl(
        tmp_path / "q.jsonl", [{"question_id": i, "category": "ab"[i % 2], "turns": ["x"]} for i in range(6)]
    )
    cfg = eval_cfg(f"data.path={path}", "data.per_category=2")
    assert [q.question_id for q in question_set(cfg.data, cfg.validation)] == ["0", "1", "2", "3"]
    cfg = eval_cfg(f"data.path={path}", "data.skip=1", "data.limit=2")
    assert [q.question_id for q in question_set(cfg.data, cfg.validation)] == ["1", "2"]


# ---------------------------------------------------------------------------------------------------------------------
# Bad inputs


@pytest.mark.parametrize(
    "lines, message",
    [
        ([json.dumps(QUESTIONS[0]), '{"question_id": 3, "turns": ["a"'], r"q.jsonl:2: malformed JSON line"),
        (
            [json.dumps({"question_id": 3, "category": "x", "turns": []})],
            r"q.jsonl:1: 'turns' must be a non-empty list",
        ),
        ([json.dumps({"question_id": 3, "turns": ["ok", "  "]})], r"q.jsonl:1: turn 2 is '  ', expected a non-empty"),
        ([json.dumps({"category": "x", "turns": ["a"]})], r"q.jsonl:1: missing field\(s\) \['question_id'\]"),
        ([json.dumps(QUESTIONS[1]), json.dumps(QUESTIONS[1])], r"question_id '2' appears twice"),
        (["[1, 2]"], r"q.jsonl:1: expected a JSON object"),
    ],
)
def test_bad_question_files(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "q.jsonl", lines)
    with pytest.raises(QuestionSetError, match=message):
        load_jsonl_questions(path)


def test_missing_question_file(tmp_path, eval_cfg):
    cfg = eval_cfg(f"data.path={tmp_path / 'nope.jsonl'}", f"out_dir={tmp_path}")
    with pytest.raises(QuestionSetError, match=r"nope.jsonl' does not exist"):
        evaluate(cfg)


@pytest.mark.slow
def test_missing_path_and_unknown_source(tmp_path, eval_cfg):
    with pytest.raises(QuestionSetError, match="needs a path"):
        question_set(eval_cfg().data, eval_cfg().validation)
    cfg = eval_cfg("data.source=sharegpt_v9")
    with pytest.raises(QuestionSetError, match="unknown question source 'sharegpt_v9'"):
        question_set(cfg.data, cfg.validation)


@pytest.mark.slow
def test_heads_for_another_target(tmp_path, eval_cfg):
    other, _ = tiny_chat_target("llama", hidden_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=1)
    heads = MedusaHeads(HeadsConfig(32, other.config.vocab_size, 4), other.get_output_embeddings().weight)
    save_drafter(heads, tmp_path / "heads", other, "tiny-other")
    with pytest.raises(DrafterMismatchError, match="hidden size 32, but target .* hidden size 64"):
        load_model(eval_cfg(f"drafter.path={tmp_path / 'heads'}"))


def test_missing_drafter(tmp_path, eval_cfg):
    with pytest.raises(FileNotFoundError, match="drafter.path=.*does not exist"):
        load_model(eval_cfg(f"drafter.path={tmp_path / 'none'}"))


@pytest.fixture
def small_eval(tmp_path, eval_cfg):
    """`small_eval(questions, *overrides)`: a short evaluation of `questions` on the chain tree, reports in
    `tmp_path/run`."""

    def compose(questions: list[dict], *overrides: str):
        path = write_jsonl(tmp_path / "q.jsonl", questions)
        return eval_cfg(
            f"data.path={path}",
            "tree=chain",
            "eval.max_new_tokens=4",
            "eval.sweep.prompts=0",
            "eval.head_accuracy=false",
            "eval.warmup=false",
            f"out_dir={tmp_path / 'run'}",
            *overrides,
        )

    return compose


@pytest.mark.slow
def test_the_store_is_seeded_with_the_training_splits_answers_alone_and_decoding_stays_lossless(tmp_path, small_eval):
    conversations = write_jsonl(
        tmp_path / "conversations.jsonl",
        [
            {
                "id": f"c{i}",
                "conversations": [{"from": "human", "value": f"Count to {i}."}, {"from": "gpt", "value": a}],
            }
            for i, a in enumerate(["One, two.", "One, two, three.", "One.", "One, two, three, four.", "Zero."] * 2)
        ],
    )
    split = [f"validation.source={conversations}", "validation.val_fraction=0.5", "validation.split_seed=1"]
    cfg = small_eval(QUESTIONS, *split, "drafter.seed_store=1000")
    model = load_model(cfg)
    tokenize = lambda text: model.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    records = [json.loads(line) for line in conversations.read_text().splitlines()]
    held_out = [r for r in records if is_validation(r["id"], 0.5, 1)]
    trained = [r for r in records if r not in held_out]
    assert held_out and trained
    assert list(model.drafter.lookup.store.documents) == [tokenize(r["conversations"][1]["value"]) for r in trained]
    assert load_model(small_eval(QUESTIONS, *split, "drafter.seed_store=0")).drafter.lookup.store.num_tokens == 0

    report = evaluate(cfg)
    assert report["losslessness"]["fraction"] == 1.0
    assert report["setup"]["lookup_store"]["seed_budget_tokens"] == 1000


@pytest.mark.slow
def test_a_killed_evaluation_keeps_its_prompts_and_resumes(tmp_path, small_eval):
    first = evaluate(small_eval(QUESTIONS))
    log_path = tmp_path / "run" / "prompts.jsonl"
    lines = log_path.read_text().splitlines(keepends=True)
    assert len(lines) == 3 == first["acceptance"]["prompts"]  # one line per prompt, written as it finished
    kept = json.loads(lines[0])
    log_path.write_text(lines[0] + lines[1][:25])  # killed while writing the second prompt's line
    (tmp_path / "run" / "report.json").unlink()
    with pytest.raises(FileExistsError, match="eval.resume=true"):
        evaluate(small_eval(QUESTIONS))
    resumed = evaluate(small_eval(QUESTIONS, "eval.resume=true"))
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [(r["question_id"], r["turn"]) for r in records] == [("1", 1), ("1", 2), ("2", 1)]
    assert records[0] == kept  # the finished prompt was not run again
    assert resumed["acceptance"]["prompts"] == 3 and resumed["summary"]["lossless"]


@pytest.mark.slow
def test_a_bf16_run_reports_each_methods_margin_to_fp32_greedy_decoded_apart(tmp_path, small_eval):
    """A bf16 run compares every output with greedy decoding of the same weights in fp32 (`eval.fp32_reference:
    auto`): its shares are what fp32 transformers greedy, decoded here apart, gives prompt by prompt, and each
    difference is reported where it is. An fp32 run has no such section unless asked; asked, stock greedy equals it."""
    cfg = small_eval(QUESTIONS, "model.dtype=bfloat16", "eval.max_new_tokens=16")
    report = evaluate(cfg)
    assert report["setup"]["dtype"] == "torch.bfloat16"
    fp32 = report["losslessness"]["fp32"]
    records = [json.loads(line) for line in (tmp_path / "run" / "prompts.jsonl").read_text().splitlines()]
    target, tokenizer = load_target(cfg.model, dtype="float32")
    eos = eos_token_ids(target, tokenizer)
    expected = []
    for r in records:
        ids = torch.tensor([r["prompt_ids"]])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])  # fmt: skip
        expected.append(out[0, ids.shape[1] :].tolist())
    assert set(fp32["per_method"]) == set(report["losslessness"]["equality"]) and fp32["prompts"] == len(records) == 3
    for method, result in fp32["per_method"].items():
        equal = [r[method]["tokens"] == tokens for r, tokens in zip(records, expected, strict=True)]
        assert result["equal"] == pytest.approx(sum(equal) / len(equal)), method
        assert result["differing_prompts"] == equal.count(False)
        for d in (d for d in fp32["differences"] if d["method"] == method):
            r = next(r for r in records if (r["question_id"], r["turn"]) == (d["question_id"], d["turn"]))
            i = d["first_divergence"]
            assert r[method]["tokens"][:i] == expected[records.index(r)][:i]
    assert "## Margin to fp32 greedy" in (tmp_path / "run" / "report.md").read_text()
    # a difference is found where it is, with fp32's logit margin there: an output made to leave fp32 greedy at token 5
    i = next(i for i, r in enumerate(records) if r["speculative"]["tokens"] == expected[i] and len(expected[i]) > 5)
    altered = json.loads(json.dumps(records))
    wrong = altered[i]["speculative"]["tokens"][5] = (expected[i][5] + 1) % target.config.vocab_size
    section = fp32_margin_section(cfg.model, load_model(cfg), altered, ["speculative"], 16)
    (difference,) = [d for d in section["differences"] if d["question_id"] == records[i]["question_id"]
                     and d["turn"] == records[i]["turn"]]  # fmt: skip
    assert difference["first_divergence"] == 5 and difference["method_token"] == wrong
    with torch.inference_mode():
        logits = target(torch.tensor([records[i]["prompt_ids"] + expected[i][:5]])).logits[0, -1]
    assert difference["margin"] == pytest.approx(float(logits[expected[i][5]] - logits[wrong]), rel=1e-4)
    assert difference["margin"] > 0  # fp32 greedy's token is fp32's argmax

    fp32_run = evaluate(small_eval(QUESTIONS, "eval.max_new_tokens=16", f"out_dir={tmp_path / 'fp32'}"))
    assert "fp32" not in fp32_run["losslessness"]
    asked = evaluate(
        small_eval(QUESTIONS, "eval.max_new_tokens=16", "eval.fp32_reference=true", f"out_dir={tmp_path / 'asked'}")
    )
    assert asked["losslessness"]["fp32"]["per_method"]["hf_greedy_stock"]["equal"] == 1.0


@pytest.mark.slow
def test_a_bf16_run_whose_fp32_copy_does_not_fit_still_writes_its_report_and_says_why(
    tmp_path, small_eval, monkeypatch
):
    """The margin to fp32 greedy loads a second, fp32 copy of the target after the timed runs; where that copy runs
    out of memory, the report is still written, with the timed runs' figures, and says why the section is missing."""

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("fault injected: no room for an fp32 copy")

    monkeypatch.setattr(precision, "load_model", out_of_memory)
    report = evaluate(small_eval(QUESTIONS, "model.dtype=bfloat16"))
    assert report["losslessness"]["fp32"]["skipped"].startswith("the fp32 copy of the target did not fit")
    md = (tmp_path / "run" / "report.md").read_text()
    assert "## Margin to fp32 greedy\n\nNot computed: the fp32 copy of the target did not fit (OutOfMemoryError)" in md
    assert set(report["speed"]["median_tokens_per_second"]) >= {"hf_greedy", "speculative"}


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_is_reported_and_skipped(small_eval):
    long_question = {"question_id": 9, "category": "long", "turns": [" ".join(["word"] * 6000)]}
    report = evaluate(small_eval([QUESTIONS[1], long_question]))
    assert [s["question_id"] for s in report["skipped"]] == ["9"]
    assert "exceeds the target's context" in report["skipped"][0]["skipped"]
    assert report["acceptance"]["prompts"] == 1 and report["summary"]["lossless"]


@pytest.mark.slow
def test_eagle3_drafter_is_evaluated_with_a_searched_tree(tmp_path, small_eval):
    """An EAGLE-3 drafter (saved natively for the tiny llama) through `evaluate` with `tree=auto`, drafting in bf16:
    the tree search picks a dynamic-tree budget, every prompt is lossless, and the report describes the EAGLE-3
    drafter and its dtype."""
    import torch

    from medusa_like import DraftVocab, Eagle3Config, Eagle3Drafter

    target, _ = tiny_chat_target("llama")
    torch.manual_seed(0)
    vocab = DraftVocab(torch.arange(512), target.config.vocab_size)
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, 512), vocab)
    drafter.init_from_target(target)
    save_drafter(drafter, tmp_path / "drafter", target, "tiny_llama")
    questions = write_jsonl(tmp_path / "calibration.jsonl", QUESTIONS)
    report = evaluate(
        small_eval(
            QUESTIONS,
            f"drafter.path={tmp_path / 'drafter'}",
            "tree=auto",
            "tree_search.calibration.source=jsonl",
            f"tree_search.calibration.path={questions}",
            "tree_search.timing_prompts=1",
            "drafter.dtype=bfloat16",  # drafts only: the target verifies in fp32
        )
    )
    assert report["summary"]["lossless"] and report["losslessness"]["fraction"] == 1.0
    assert report["acceptance"]["prompts"] == 3
    assert report["setup"]["dtype"] == "torch.float32" and report["setup"]["drafter_dtype"] == "torch.bfloat16"
    assert "torch.float32, the drafter in torch.bfloat16 on cpu" in (tmp_path / "run" / "report.md").read_text()
    # combined (the default): a budgeted tree whose learned part is a dynamic tree: depth, top-k, nodes
    assert re.fullmatch(r"d\d+k\d+n\d+\+lookup\d+n\d+", report["tree_search"]["label"])
    assert "eagle3" in json.dumps(report["setup"]).lower()
    assert report["tree_search"]["prompt_lookup_num_tokens"] in range(2, 11)
    assert set(report["methods"]) == {"plain_loop", "learned", "lookup", "speculative"}


def test_learned_alone_decodes_with_its_own_tree_resolved_by_the_learned_drafter(tmp_path, eval_cfg):
    """make_runners' `learned_tree` (`learned_alone_tree`: the tree search's learned tree, `learned_tree=`) is what the
    learned drafter alone decodes with, in place of the combined tree's learned part: a tree deeper than its 4 heads
    is refused before the prompt runs, a tree it can fill decodes losslessly."""
    from medusa_like.decoding.tree import InvalidTreeError
    from medusa_like.evaluation.methods import learned_alone_tree, make_runners

    cfg = eval_cfg(f"data.path={write_jsonl(tmp_path / 'q.jsonl', QUESTIONS)}", "eval.max_new_tokens=8")
    model = load_model(cfg)
    tree = model.resolve_tree({"dynamic": {"depth": 1, "top_k": 2, "num_nodes": 2}})
    ids = model.chat_ids([{"role": "user", "content": QUESTIONS[0]["turns"][0]}])
    too_deep = {"paths": [[0], [0, 0], [0, 0, 0], [0] * 4, [0] * 5]}
    deep = learned_alone_tree(model, tree, too_deep)
    with pytest.raises(InvalidTreeError, match="depth 5 but .* 4 deep"):
        make_runners(model, tree, 3, ["learned"], learned_tree=deep)["learned"](ids, 8)
    learned = learned_alone_tree(model, tree, {"paths": [[0], [1], [0, 0]]})
    runners = make_runners(model, tree, 3, ["learned"], learned_tree=learned)
    tokens, stats = runners["learned"](ids, 8)
    assert tokens == runners["hf_greedy"](ids, 8)[0]
    assert all(a <= 2 for a in stats["accepted_draft"])  # the static tree is 2 deep


@pytest.mark.slow
def test_combined_evaluation_times_each_source_and_never_leaks_an_answer_into_the_store(tmp_path, eval_cfg):
    """drafter.mode=combined (the default): the learned drafter alone, lookup alone and combined on the same prompts,
    each lossless, with per-source shares; and while any method runs a prompt, the output store holds only the
    answers of the prompts before it (a store fed inside `generate` would show the count rise mid-prompt)."""
    from medusa_like.evaluation import prompt_loop
    from medusa_like.evaluation.methods import make_runners

    questions = write_jsonl(tmp_path / "questions.jsonl", QUESTIONS)
    cfg = eval_cfg(f"data.path={questions}", "eval.max_new_tokens=12")
    model = load_model(cfg)
    store = model.drafter.lookup.store
    tree = model.resolve_tree("dynamic")
    runners = make_runners(model, tree, 3)
    assert {"learned", "lookup", "speculative"} <= set(runners)
    seen = []

    def spy(name, run):
        def wrapped(ids, max_new_tokens):
            seen.append((name, len(store)))
            return run(ids, max_new_tokens)

        return wrapped

    spied = {name: spy(name, run) for name, run in runners.items()}
    records = prompt_loop.run_questions(
        model, question_set(cfg.data, cfg.validation), spied, 12, 2, tree, tmp_path / "prompts.jsonl"
    )
    per_prompt = [seen[i : i + len(runners)] for i in range(0, len(seen), len(runners))]
    assert [{count for _, count in calls} for calls in per_prompt] == [{0}, {1}, {2}]
    assert len(store) == len(records) == 3
    assert all(store.contains(r["hf_greedy"]["tokens"]) for r in records)
    for r in records:
        for name in ("learned", "lookup", "speculative"):
            assert r[name]["tokens"] == r["hf_greedy"]["tokens"], name
