"""Conversation sources, the truncated ShareGPT file, the train/validation split and the distilled-data datamodule."""

import json

import pytest
import torch
from datasets import Dataset, DatasetDict

from medusa_like.data.datamodule import TrainingDataModule
from medusa_like.data.sharegpt import ReadStats, iter_json_array, sharegpt_path
from medusa_like.data.sources import load_conversations, user_turns
from medusa_like.data.split import draft_vocab_from_training_split, is_validation, split_token_counts, training_answers
from medusa_like.data.storage import FEATURES, save_dataset


def sharegpt_record(i: int, turns: int = 1) -> dict:
    conv = []
    for t in range(turns):
        conv += [{"from": "human", "value": f"question {i}.{t}"}, {"from": "gpt", "value": f"answer {i}.{t}"}]
    return {"id": f"conv{i}_0", "conversations": conv}


def test_truncated_array_yields_only_complete_records(tmp_path):
    text = json.dumps([sharegpt_record(i) for i in range(4)], indent=2)
    cut = text.index('"conv3_0"') + 5  # inside the fourth record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    stats = ReadStats()
    records = list(iter_json_array(path, stats))
    assert [r["id"] for r in records] == ["conv0_0", "conv1_0", "conv2_0"]
    assert stats.complete == 3 and stats.truncated and stats.dropped_chars > 0
    with pytest.raises(ValueError, match="ends inside element 4"):
        list(iter_json_array(path, allow_truncated=False))
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    stats = ReadStats()
    assert len(list(iter_json_array(whole, stats))) == 4 and not stats.truncated


@pytest.mark.slow
def test_packaged_sharegpt_file_reads_every_complete_record():
    stats = ReadStats()
    count = 0
    for record in iter_json_array(sharegpt_path(), stats):
        assert isinstance(record["id"], str) and isinstance(record["conversations"], list)
        count += 1
    assert stats.truncated  # the packaged file is cut inside its last record
    assert count == stats.complete == 17_671  # the README's count of complete records
    first = next(load_conversations("sharegpt"))
    assert first["messages"][0]["role"] == "user" and first["group"] == first["id"].rsplit("_", 1)[0]


def test_local_sources_in_sharegpt_and_chat_form_normalise_alike(tmp_path):
    sharegpt = [sharegpt_record(i, turns=2) for i in range(3)]
    chat = [
        {
            "id": r["id"],
            "messages": [
                {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in r["conversations"]
            ],
        }
        for r in sharegpt
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in sharegpt) + "\n\n")
    (tmp_path / "b.json").write_text(json.dumps(chat))
    (tmp_path / "c.json").write_text(json.dumps({"data": chat}))
    Dataset.from_list(chat).save_to_disk(str(tmp_path / "d"))
    DatasetDict({"test": Dataset.from_list(chat)}).save_to_disk(str(tmp_path / "e"))
    expected = list(load_conversations(str(tmp_path / "a.jsonl")))
    assert len(expected) == 3 and expected[0]["messages"][2] == {"role": "user", "content": "question 0.1"}
    assert user_turns(expected[1]) == ([], ["question 1.0", "question 1.1"])
    for source, split in (("b.json", "train"), ("c.json", "train"), ("d", "train"), ("e", "test")):
        assert list(load_conversations(str(tmp_path / source), split=split)) == expected, source
    assert len(list(load_conversations(str(tmp_path / "a.jsonl"), limit=2))) == 2


def test_bad_sources_fail_with_what_was_expected(tmp_path):
    (tmp_path / "role.jsonl").write_text(json.dumps({"conversations": [{"from": "robot", "value": "x"}]}))
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        list(load_conversations(str(tmp_path / "role.jsonl")))
    (tmp_path / "keys.jsonl").write_text(json.dumps({"text": "x"}))
    with pytest.raises(ValueError, match=r"'conversations'.*'messages'.*\['text'\]"):
        list(load_conversations(str(tmp_path / "keys.jsonl")))
    (tmp_path / "line.jsonl").write_text(json.dumps(sharegpt_record(0)) + "\n{oops\n")
    with pytest.raises(ValueError, match="line.jsonl:2"):
        list(load_conversations(str(tmp_path / "line.jsonl")))
    (tmp_path / "cut.json").write_text(json.dumps([sharegpt_record(0), sharegpt_record(1)])[:-30])
    with pytest.raises(ValueError, match="ends inside element 2"):
        list(load_conversations(str(tmp_path / "cut.json")))
    whole = json.dumps([sharegpt_record(0), sharegpt_record(1), sharegpt_record(2)])
    broken = whole.replace('"question 1.0"', '"question 1.0",,', 1)  # a malformed second element, not a cut file
    (tmp_path / "broken.json").write_text(broken)
    with pytest.raises(ValueError, match=r"element 2 is not valid JSON") as err:
        list(load_conversations(str(tmp_path / "broken.json")))
    assert "ends inside" not in str(err.value)
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(ValueError, match="expected a .json or .jsonl"):
        list(load_conversations(str(tmp_path / "t.txt")))


def test_records_without_a_user_turn_are_skipped(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"}]},
        {"id": "c", "messages": []},
    ]
    (tmp_path / "x.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    convs = list(load_conversations(str(tmp_path / "x.jsonl")))
    assert [c["id"] for c in convs] == ["b"] and convs[0]["messages"] == [{"role": "user", "content": "q"}]


def test_split_is_deterministic_about_the_requested_size_and_seeded():
    groups = [f"g{i}" for i in range(4000)]
    val = [g for g in groups if is_validation(g, 0.1)]
    assert 300 < len(val) < 500
    assert val == [g for g in reversed(groups) if is_validation(g, 0.1)][::-1]  # order-independent
    assert val != [g for g in groups if is_validation(g, 0.1, seed=1)]
    assert not any(is_validation(g, 0.0) for g in groups)
    with pytest.raises(ValueError, match="val_fraction"):
        is_validation("g", 1.0)


def test_training_answers_are_the_training_splits_answers_in_order(tmp_path):
    path = tmp_path / "conversations.jsonl"
    path.write_text("\n".join(json.dumps(sharegpt_record(i, turns=2)) for i in range(20)))
    held_out = [i for i in range(20) if is_validation(f"conv{i}_0", 0.5, seed=1)]
    assert 0 < len(held_out) < 20
    expected = [f"answer {i}.{t}" for i in range(20) if i not in held_out for t in range(2)]
    assert list(training_answers(str(path), 0.5, split_seed=1)) == expected
    assert len(list(training_answers(str(path), 0.0))) == 40  # no validation split: every answer


def write_distilled(root, rows: list[dict]):
    Dataset.from_list(rows, features=FEATURES).save_to_disk(str(root / "dataset"))
    return root


def test_datamodule_keeps_validation_groups_out_of_training(tmp_path):
    rows = []
    for i in range(60):
        n = 5 + i % 7
        rows.append(
            {
                "id": f"c{i}_{i % 2}",
                "group": f"c{i // 2}",
                "input_ids": list(range(1, n + 1)),
                "loss_mask": [0, 0] + [1] * (n - 2),
            }
        )
    rows.append({"id": "empty", "group": "empty", "input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]})  # one target only
    dm = TrainingDataModule(str(write_distilled(tmp_path, rows)), val_fraction=0.3, batch_size=4, max_length=8)
    dm.setup("fit")
    train_idx, val_idx = set(dm.train_set["index"]), set(dm.val_set["index"])
    assert train_idx.isdisjoint(val_idx) and len(train_idx) + len(val_idx) == 60  # "empty" was filtered out
    for index in val_idx:
        assert is_validation(rows[index]["group"], 0.3)
    for index in train_idx:
        assert not is_validation(rows[index]["group"], 0.3)
    batch = next(iter(dm.val_dataloader()))
    lengths = [min(len(rows[i]["input_ids"]), 8) for i in batch["index"].tolist()]
    assert batch["input_ids"].shape == (4, max(lengths)) and batch["input_ids"].dtype == torch.long
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert (batch["loss_mask"] <= batch["attention_mask"]).all()
    first = rows[batch["index"][0]]
    assert batch["input_ids"][0, : lengths[0]].tolist() == first["input_ids"][:8]


def test_draft_vocabulary_counts_come_from_the_training_split_alone(tmp_path):
    groups = [f"conv{i}" for i in range(40)]
    held_out = {g for g in groups if is_validation(g, 0.25)}
    assert 0 < len(held_out) < len(groups)
    rows = [
        {"id": g, "group": g, "input_ids": [i % 5, 5 + i % 5, 7], "loss_mask": [0, 1, 1]} for i, g in enumerate(groups)
    ]
    save_dataset(rows, tmp_path / "dataset")
    train, validation = split_token_counts(tmp_path, 12, 0.25)
    expected_train, expected_validation = torch.zeros(12), torch.zeros(12)
    for i, g in enumerate(groups):
        counts = expected_validation if g in held_out else expected_train
        counts[5 + i % 5] += 1
        counts[7] += 1
    assert train.tolist() == expected_train.tolist() and validation.tolist() == expected_validation.tolist()


def test_the_draft_vocabulary_comes_from_the_training_split_alone(tmp_path):
    groups = [f"conv{i}" for i in range(40)]
    held_out = [g for g in groups if is_validation(g, 0.25)]
    assert 0 < len(held_out) < len(groups)
    # every training conversation supervises tokens 1 and 2; each held-out one its own token, more often than those
    rows = [
        {"id": g, "group": g, "input_ids": [0, 1, 2], "loss_mask": [0, 1, 1]} for g in groups if g not in held_out
    ] + [
        {"id": g, "group": g, "input_ids": [0] + [10 + i] * 50, "loss_mask": [0] + [1] * 50}
        for i, g in enumerate(held_out)
    ]
    save_dataset(rows, tmp_path / "dataset")
    vocab = draft_vocab_from_training_split(tmp_path, 2, 64, val_fraction=0.25)
    assert vocab.token_ids.tolist() == [1, 2] and vocab.target_vocab_size == 64
    everything = draft_vocab_from_training_split(tmp_path, 2, 64, val_fraction=0.0)
    assert everything.token_ids.tolist() != [1, 2]  # with no split, the held-out tokens would win
    with pytest.raises(ValueError, match="training data directory"):
        draft_vocab_from_training_split(None, 2, 64, 0.25)
