"""Validation prompts that stand alone and were never seen: repeats, prompts the training split asks, conversations
whose text seeds the output store, and continuation turns are dropped before any is evaluated."""

import json
from pathlib import Path

import pytest

from medusa_like.data.sources import load_conversations, user_turns
from medusa_like.data.split import TrainingTexts, is_validation, normalise_text, training_answers
from medusa_like.evaluation.questions import is_continuation, load_validation_questions, unseen_problem

VAL_FRACTION, SEED = 0.5, 0
IDS = [f"c{i}" for i in range(60)]
HELD_OUT = [i for i in IDS if is_validation(i, VAL_FRACTION, SEED)]
TRAINED = [i for i in IDS if i not in HELD_OUT]
ANSWER = "Rain falls softly on the quiet town while the streetlights hum along"  # 12 words


def conversation(conv_id: str, *texts: str) -> dict:
    """A chat-form conversation: user and assistant texts alternating, user first."""
    roles = ("user", "assistant")
    return {"id": conv_id, "messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]}


def write_conversations(path: Path, conversations: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(c) for c in conversations) + "\n")
    return str(path)


def distinct() -> list[dict]:
    """Conversations whose prompts are all distinct, one per id, in id order."""
    return [conversation(i, f"Question number {i}: what is {k} squared?", f"It is {k * k}.") for k, i in enumerate(IDS)]


def kept_ids(path: str, **kwargs) -> list[str]:
    return [q.question_id for q in load_validation_questions(path, VAL_FRACTION, SEED, **kwargs)]


def test_the_split_has_both_sides():
    assert len(HELD_OUT) >= 6 and len(TRAINED) >= 6


def test_normalised_text_ignores_case_spacing_and_end_punctuation():
    assert normalise_text("  Write a HAIKU\n about   rain!! ") == normalise_text("write a haiku about rain.")
    assert normalise_text("« Hello, World! »") == "hello, world"  # punctuation inside is kept
    assert normalise_text("rain") != normalise_text("snow")


def test_a_repeated_validation_prompt_is_dropped(tmp_path):
    convs = distinct()
    first, second = HELD_OUT[1], HELD_OUT[3]
    convs[IDS.index(first)] = conversation(first, "Write a haiku about rain.", "Drops on the roof.")
    convs[IDS.index(second)] = conversation(second, "  write a HAIKU about   rain!", "Another haiku.")
    path = write_conversations(tmp_path / "c.jsonl", convs)
    assert kept_ids(path) == [i for i in HELD_OUT if i != second]


def test_a_validation_prompt_the_training_split_asks_is_dropped(tmp_path):
    convs = distinct()
    held, trained = HELD_OUT[2], TRAINED[-1]  # the training conversation comes later in the file
    convs[IDS.index(held)] = conversation(held, "Explain photosynthesis.", "Plants make sugar.")
    convs[IDS.index(trained)] = conversation(trained, "explain Photosynthesis", "Light becomes sugar.")
    path = write_conversations(tmp_path / "c.jsonl", convs)
    assert kept_ids(path) == [i for i in HELD_OUT if i != held]
    # asked as a later turn of a training conversation: its answer follows it in the store's seed
    convs[IDS.index(trained)] = conversation(trained, "Hello there.", "Hi.", "Explain photosynthesis!", "Sugar.")
    path = write_conversations(tmp_path / "c.jsonl", convs)
    assert kept_ids(path) == [i for i in HELD_OUT if i != held]


def test_nothing_of_a_kept_validation_conversation_is_in_the_stores_seed(tmp_path):
    convs = distinct()
    held, trained = HELD_OUT[0], TRAINED[0]
    convs[IDS.index(held)] = conversation(held, "Describe a rainy evening.", ANSWER)
    convs[IDS.index(trained)] = conversation(trained, "Write one line about weather.", ANSWER.upper() + "!")
    path = write_conversations(tmp_path / "c.jsonl", convs)
    kept = kept_ids(path)
    assert held not in kept and len(kept) == len(HELD_OUT) - 1
    seed = {normalise_text(a) for a in training_answers(path, VAL_FRACTION, SEED)}
    by_id = {c["id"]: c for c in convs}
    for conv_id in kept:
        assert not {normalise_text(m["content"]) for m in by_id[conv_id]["messages"]} & seed


def test_short_answers_shared_with_the_training_split_keep_a_prompt(tmp_path):
    convs = [conversation(i, f"Say yes to question {k}.", "Yes.") for k, i in enumerate(IDS)]
    assert kept_ids(write_conversations(tmp_path / "c.jsonl", convs)) == HELD_OUT


@pytest.mark.parametrize("text", ["continue", "Continue writing please", "go on.", "contiue", "Are you sure?"])
def test_a_continuation_turn_is_dropped(tmp_path, text):
    convs = distinct()
    held = HELD_OUT[1]
    convs[IDS.index(held)] = conversation(held, text, "More text.")
    path = write_conversations(tmp_path / "c.jsonl", convs)
    assert kept_ids(path) == [i for i in HELD_OUT if i != held]


def test_continuations_are_told_from_short_prompts():
    assert is_continuation("Write above separately for john and jane")
    assert is_continuation("...")
    for text in ("Explain quantum mechanics", "hi", "Continuous integration explained", "What is 12 times 7?"):
        assert not is_continuation(text), text


def test_a_later_part_of_a_split_conversation_is_dropped():
    """ShareGPT cut long conversations into parts `<id>_<n>` (n: the message it starts at) of one group; a later
    part's first turn follows text the model would never see."""
    training = TrainingTexts()
    opening = {"id": "abc_0", "group": "abc", "messages": conversation("", "Plan a trip to Norway.")["messages"]}
    later = {"id": "abc_12", "group": "abc", "messages": conversation("", "Do the same for Sweden.")["messages"]}
    assert unseen_problem(opening, "Plan a trip to Norway.", training, set()) is None
    assert unseen_problem(later, "Do the same for Sweden.", training, set()) == "later parts of split conversations"


def test_the_limit_counts_kept_prompts(tmp_path):
    convs = distinct()
    convs[IDS.index(HELD_OUT[0])] = conversation(HELD_OUT[0], "continue", "More.")
    path = write_conversations(tmp_path / "c.jsonl", convs)
    assert kept_ids(path, limit=3) == HELD_OUT[1:4]


@pytest.mark.slow
def test_the_default_validation_prompts_stand_alone_and_were_never_seen():
    """`make run`'s evaluation prompts (ShareGPT's validation split of conf/data/sharegpt_text.yaml, after the 8 the
    tree search may calibrate on): none is a later part of a split conversation or a continuation, none repeats
    another, and the training split asks none of them."""
    questions = load_validation_questions("sharegpt", 0.1, 0, limit=24, max_turns=1)
    prompts = {q.question_id: normalise_text(q.turns[0]) for q in questions}
    assert len(questions) == 24 and len(set(prompts.values())) == 24
    assert all(i.endswith("_0") and not is_continuation(prompts[i]) for i in prompts)
    asked = set()
    for conv in load_conversations("sharegpt"):
        if not is_validation(conv["group"], 0.1, 0):
            asked.update(normalise_text(t) for t in user_turns(conv)[1])
    assert not asked & set(prompts.values())
