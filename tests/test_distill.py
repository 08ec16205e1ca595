"""Building training data on tiny random targets: loss masks, resuming after an interruption, shards, multi-turn,
recipe checks, the teacher-forced `original` recipe, and two runs building one data directory at once."""

import json
import logging
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from medusa_like.data import conversation_text, generation, masks, storage
from medusa_like.data.prepare import ensure_dataset, load_model
from medusa_like.data.storage import check_recipe, is_complete, load_distilled, recipe
from medusa_like.tiny import tiny_chat_target

from .conftest import TINY_TRAIN, compose_config


def chatty_target(eos_logit: float = 9.7):
    """A tiny random llama whose projection favours the end-of-turn token (~25% per step), so answers finish."""
    model, tokenizer = tiny_chat_target("llama", tie_word_embeddings=False)
    old = model.get_output_embeddings()
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = eos_logit
    model.set_output_embeddings(head)
    model.requires_grad_(False)
    return model, tokenizer


@pytest.fixture(scope="module")
def target():
    return chatty_target()


def conversations(n: int, turns: int = 1) -> list[dict]:
    out = []
    for i in range(n):
        messages = []
        for t in range(turns):
            messages += [
                {"role": "user", "content": f"Question {i}.{t}: name a colour."},
                {"role": "assistant", "content": "x"},
            ]
        out.append({"id": f"c{i}", "group": f"c{i}", "messages": messages})
    return out


GEN = generation.GenerationConfig(temperature=0.8, max_new_tokens=8, max_prompt_tokens=64, max_length=256)


def segments(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_loss_mask_covers_the_answers_and_their_end_token_only():
    _, tokenizer = tiny_chat_target("llama")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two, thr"},
    ]
    ids, mask = masks.build_sample(tokenizer, messages, finished=[True, False])
    assert len(ids) == len(mask)
    spans = segments(mask)
    assert len(spans) == 2
    assert tokenizer.decode(ids[slice(*spans[0])]) == "Hello! How can I help?<|im_end|>"
    assert tokenizer.decode(ids[slice(*spans[1])]) == "One, two, thr"  # cut off: no end token to learn
    assert tokenizer.decode(ids[: spans[0][0]]).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_distilled_rows_hold_the_targets_own_answers(tmp_path, target):
    model, tokenizer = target
    path = generation.run(
        model, tokenizer, conversations(6), tmp_path / "d", GEN, batch_size=4, chunk_size=4, progress=False
    )
    data = storage.load_distilled(tmp_path / "d")
    assert path == tmp_path / "d" / "dataset" and data["id"] == [f"c{i}" for i in range(6)]
    eos = tokenizer.eos_token_id
    for row in data:
        spans = segments(row["loss_mask"])
        assert len(spans) == 1 and 1 <= spans[0][1] - spans[0][0] <= GEN.max_new_tokens + 2
        prompt = tokenizer.decode(row["input_ids"][: spans[0][0]])
        assert f"Question {row['id'][1:]}.0" in prompt and prompt.endswith("<|im_start|>assistant\n")
        answer = row["input_ids"][slice(*spans[0])]
        assert eos not in answer[:-1]  # the end token, if learned, closes the answer
    assert any(row["input_ids"][segments(row["loss_mask"])[0][1] - 1] == eos for row in data)


@pytest.mark.slow
def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, target):
    model, tokenizer = target
    convs = conversations(12)
    kwargs = dict(batch_size=2, chunk_size=4, progress=False)
    generation.run(model, tokenizer, convs, tmp_path / "whole", GEN, **kwargs)

    calls = {"n": 0}
    generate = model.generate

    def interrupted(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # the first batch of chunk 1
            raise KeyboardInterrupt
        return generate(*args, **kw)

    model.generate = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            generation.run(model, tokenizer, convs, tmp_path / "resumed", GEN, **kwargs)
        chunks = tmp_path / "resumed" / "chunks"
        assert sorted(p.name for p in chunks.iterdir()) == ["chunk-00000"]
        assert not (tmp_path / "resumed" / "dataset").exists()
        (chunks / ".chunk-00001.tmp-4242").mkdir()  # as if killed while saving chunk 1
        calls["n"] = 100
        generation.run(model, tokenizer, convs, tmp_path / "resumed", GEN, **kwargs)
    finally:
        del model.generate
    assert calls["n"] == 104  # chunks 1 and 2 only, two batches each
    assert not (chunks / ".chunk-00001.tmp-4242").exists()
    whole = storage.load_distilled(tmp_path / "whole").to_list()
    assert storage.load_distilled(tmp_path / "resumed").to_list() == whole


@pytest.mark.slow
def test_shards_and_time_boxed_runs_combine_into_the_same_dataset(tmp_path, target):
    model, tokenizer = target
    convs = conversations(12)
    kwargs = dict(batch_size=4, chunk_size=4, progress=False)
    generation.run(model, tokenizer, convs, tmp_path / "whole", GEN, **kwargs)
    out = tmp_path / "sharded"
    assert generation.run(model, tokenizer, convs, out, GEN, shard=1, num_shards=2, **kwargs) is None
    assert generation.run(model, tokenizer, convs, out, GEN, shard=0, num_shards=2, max_chunks=1, **kwargs) is None
    with pytest.raises(FileNotFoundError, match="1 of 3 chunks missing"):
        storage.combine(out, 3)
    assert generation.run(model, tokenizer, convs, out, GEN, shard=0, num_shards=2, **kwargs) == out / "dataset"
    assert storage.load_distilled(out).to_list() == storage.load_distilled(tmp_path / "whole").to_list()
    with pytest.raises(ValueError, match="shard must be in"):
        generation.run(model, tokenizer, convs, out, GEN, shard=2, num_shards=2, **kwargs)


def test_a_changed_recipe_is_refused(tmp_path, target):
    model, tokenizer = target
    generation.run(model, tokenizer, conversations(4), tmp_path / "d", GEN, chunk_size=4, progress=False)
    hotter = generation.GenerationConfig(**{**GEN.__dict__, "temperature": 1.2})
    with pytest.raises(ValueError, match="another recipe.*generation"):
        generation.run(model, tokenizer, conversations(4), tmp_path / "d", hotter, chunk_size=4, progress=False)
    with pytest.raises(ValueError, match="another recipe.*num_conversations"):
        generation.run(model, tokenizer, conversations(5), tmp_path / "d", GEN, chunk_size=4, progress=False)
    # a finished dataset is checked the same way before training reuses it: the source and ids count too
    same = recipe(model, conversations(4), "distilled", "", GEN.__dict__, 4, "")
    check_recipe(tmp_path / "d", same)
    with pytest.raises(ValueError, match="another recipe.*source"):
        check_recipe(tmp_path / "d", {**same, "source": "B.jsonl"})
    other_ids = [{**c, "id": c["id"] + "x"} for c in conversations(4)]
    with pytest.raises(ValueError, match="another recipe.*conversation_ids_sha256"):
        check_recipe(tmp_path / "d", recipe(model, other_ids, "distilled", "", GEN.__dict__, 4, ""))


def test_all_turns_are_answered_on_the_regenerated_history(tmp_path, target):
    model, tokenizer = target
    gen = generation.GenerationConfig(**{**GEN.__dict__, "turns": "all"})
    generation.run(
        model, tokenizer, conversations(8, turns=3), tmp_path / "d", gen, batch_size=4, chunk_size=8, progress=False
    )
    rows = storage.load_distilled(tmp_path / "d").to_list()
    assert len(rows) == 8
    answered = []
    for row in rows:
        text = tokenizer.decode(row["input_ids"])
        spans = segments(row["loss_mask"])
        assert text.count("<|im_start|>user") == len(spans)  # one user turn per answer
        for t in range(len(spans)):
            assert f"Question {row['id'][1:]}.{t}:" in text
        assert "x<|im_end|>" not in text  # the original answers are gone
        answered.append(len(spans))
    assert max(answered) == 3 and min(answered) >= 1


def test_select_conversations_skips_long_prompts(tmp_path):
    _, tokenizer = tiny_chat_target("llama")
    records = [{"id": "long", "conversations": [{"from": "human", "value": "word " * 200}]}]
    records += [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"short {i}"}]} for i in range(3)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    picked = generation.select_conversations(str(tmp_path / "c.jsonl"), 2, tokenizer, GEN)
    assert [c["id"] for c in picked] == ["s0", "s1"]


def test_a_tokenizer_without_chat_template_is_an_error():
    _, tokenizer = tiny_chat_target("llama")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        masks.build_sample(tokenizer, [{"role": "user", "content": "hi"}], [])


def test_original_recipe_keeps_the_conversations_own_answers(tmp_path, target):
    model, tokenizer = target
    convs = conversations(5, turns=2)
    path = conversation_text.run(model, tokenizer, convs, tmp_path / "o", max_length=512, chunk_size=2, progress=False)
    rows = storage.load_distilled(tmp_path / "o").to_list()
    assert path == tmp_path / "o" / "dataset" and [r["id"] for r in rows] == [c["id"] for c in convs]
    for row, conv in zip(rows, convs, strict=True):
        ids, mask = masks.build_sample(tokenizer, conv["messages"], [True, True])
        assert row["input_ids"] == ids and row["loss_mask"] == mask
        assert len(segments(row["loss_mask"])) == 2  # both answers supervised
    made = json.loads((tmp_path / "o" / "recipe.json").read_text())
    assert made["recipe"] == "original" and made["generation"] == {"max_length": 512}


def test_nothing_is_written_for_an_empty_source(tmp_path, target):
    model, tokenizer = target
    with pytest.raises(ValueError, match="no conversations"):
        conversation_text.run(model, tokenizer, [], tmp_path / "e", max_length=64, progress=False)
    assert not (tmp_path / "e").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Two runs building one data directory


def build(name: str, tmp_path: Path, data: Path, gate: Path | None, results) -> None:
    """One run's data step (forked: a process of its own), counting its target forwards; logs into <name>.log."""
    handler = logging.FileHandler(tmp_path / f"{name}.log")
    logging.getLogger("medusa_like").addHandler(handler)
    logging.getLogger("medusa_like").setLevel(logging.INFO)
    cfg = compose_config("train", tmp_path / name, *TINY_TRAIN, data_dir=data)  # composed in the child: no fixture here
    target, tokenizer = load_model(cfg.model)
    forwards = []

    def count(module, args, output):  # the first forward waits for the test's go-ahead, if given a gate
        while gate is not None and not forwards and not gate.exists():
            time.sleep(0.05)
        forwards.append(1)

    target.register_forward_hook(count)
    ensure_dataset(cfg, target, tokenizer)
    results.put((name, len(forwards)))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


@pytest.mark.slow
def test_two_runs_building_one_data_directory_build_it_once(tmp_path, train_cfg):
    data, gate = tmp_path / "data", tmp_path / "go"
    data_dir = Path(train_cfg(out_dir=tmp_path / "probe", data_dir=data).data.dir)
    lock = data_dir.with_name(f".{data_dir.name}.build-shard0-of-1.lock")
    context = multiprocessing.get_context("fork")  # a process each, without re-importing torch
    results = context.Queue()
    first = context.Process(target=build, args=("first", tmp_path, data, gate, results))
    first.start()  # holds the build lock, stopped at its first target forward
    wait_for(
        lambda: (tmp_path / "first.log").exists() and "distilling" in (tmp_path / "first.log").read_text(),
        300,
        "the first run never started building",
    )
    second = context.Process(target=build, args=("second", tmp_path, data, None, results))
    second.start()
    try:
        wait_for(
            lambda: (tmp_path / "second.log").exists() and "waiting for" in (tmp_path / "second.log").read_text(),
            300,
            "the second run did not wait for the first",
        )
    finally:
        gate.touch()
    counts = dict(results.get(timeout=300) for _ in range(2))
    first.join(timeout=60)
    second.join(timeout=60)
    assert first.exitcode == second.exitcode == 0 and lock.exists()
    assert counts["first"] > 0 and counts["second"] == 0, counts  # the second found the rows built
    assert is_complete(data_dir) and len(load_distilled(data_dir)) > 0


# ---------------------------------------------------------------------------------------------------------------------
# This project's batched loop as the answers' engine (distill.engine=medusa_like)


def loop_engine(model, tokenizer):
    from medusa_like.drafters.lookup import LookupDrafter
    from medusa_like.model import MedusaLikeModel

    return generation.loop_generator(MedusaLikeModel(model, tokenizer, LookupDrafter(), tuned_layers=False))


def test_the_loops_greedy_answers_are_transformers_greedy_of_each_prompt_alone():
    """Greedy answers from the batched loop, ragged prompts two rows at a time (the next prompt taking a finished
    row's place), rows stopping at EOS at different steps: each equals transformers' `generate` on that prompt alone,
    on the same target built again (untouched)."""
    model, tokenizer = chatty_target(eos_logit=0.5)  # greedy then stops after 5, 9, 10 tokens or at the length
    texts = [f"Question {i}: {'name a colour, ' * i}please." for i in range(5)]
    prompts = [tokenizer(masks.render(tokenizer, [{"role": "user", "content": t}], True))["input_ids"] for t in texts]
    greedy = generation.GenerationConfig(**{**GEN.__dict__, "temperature": 0.0, "max_new_tokens": 12})
    eos = [tokenizer.eos_token_id]
    ours = loop_engine(model, tokenizer)(prompts, greedy, eos, seed=0, batch_size=2)
    untouched, _ = chatty_target(eos_logit=0.5)
    for prompt, row in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = untouched.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
            )
        assert row == out[0, len(prompt) :].tolist()
    assert len({len(row) for row in ours}) > 1  # rows stopped at different steps


@pytest.mark.slow
def test_the_loops_answers_resume_after_a_kill_and_do_not_depend_on_the_batch_size(tmp_path, target, monkeypatch):
    """Sampled answers from the batched loop, every turn of two-turn conversations: a build killed inside chunk 1
    (its first turn answered) and resumed holds exactly the rows of an uninterrupted one (none lost, none twice), and
    so do builds at other batch sizes and a turn's prompts split over several calls (each prompt samples from its own
    seed); a directory built by transformers' engine is refused for this one."""
    model, tokenizer = target
    convs = conversations(12, turns=2)
    gen = generation.GenerationConfig(**{**GEN.__dict__, "turns": "all"})
    engine = loop_engine(model, tokenizer)
    kwargs = dict(chunk_size=4, progress=False, engine="medusa_like")
    generation.run(model, tokenizer, convs, tmp_path / "whole", gen, batch_size=2, generator=engine, **kwargs)

    calls = {"n": 0}

    def killed_at_the_fourth_call(*args):
        calls["n"] += 1
        if calls["n"] == 4:  # chunk 1's second turn: a call a turn
            raise KeyboardInterrupt
        return engine(*args)

    with pytest.raises(KeyboardInterrupt):
        run_args = (model, tokenizer, convs, tmp_path / "resumed", gen)
        generation.run(*run_args, batch_size=2, generator=killed_at_the_fourth_call, **kwargs)
    assert sorted(p.name for p in (tmp_path / "resumed" / "chunks").iterdir()) == ["chunk-00000"]
    generation.run(*run_args, batch_size=2, generator=killed_at_the_fourth_call, **kwargs)
    assert calls["n"] == 8  # chunks 1 and 2 only, two turns each
    whole = storage.load_distilled(tmp_path / "whole").to_list()
    assert storage.load_distilled(tmp_path / "resumed").to_list() == whole
    generation.run(model, tokenizer, convs, tmp_path / "wider", gen, batch_size=4, generator=engine, **kwargs)
    assert storage.load_distilled(tmp_path / "wider").to_list() == whole
    monkeypatch.setattr(generation, "BATCHES_PER_CALL", 1)  # one prompt a call: four calls a turn of a chunk
    generation.run(model, tokenizer, convs, tmp_path / "narrow", gen, batch_size=1, generator=engine, **kwargs)
    assert storage.load_distilled(tmp_path / "narrow").to_list() == whole

    generation.run(model, tokenizer, convs[:4], tmp_path / "hf", GEN, chunk_size=4, progress=False)
    with pytest.raises(ValueError, match="another recipe.*generation"):
        generation.run(model, tokenizer, convs[:4], tmp_path / "hf", GEN, generator=engine, **kwargs)
