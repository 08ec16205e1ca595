"""The evaluation's prompt loop: every turn of every question through every method, resumable.

Turn n of a question carries the reference's answers to turns 1..n-1; at `eval.batch_size` B, B questions are asked
at once, turn by turn. Each prompt's result is appended to a JSON Lines
log (`prompts.jsonl`) as soon as it is measured, so a killed run keeps what it did; a later run with the same log skips
the prompts already there. A prompt that cannot fit the target's context is recorded as skipped.
"""

import json
import logging
from pathlib import Path

import torch

from medusa_like.decoding.checks import check_context
from medusa_like.evaluation.methods import REFERENCE
from medusa_like.evaluation.questions import Question
from medusa_like.evaluation.timing import Runner, run_batch_interleaved, run_interleaved
from medusa_like.io import read_jsonl

log = logging.getLogger(__name__)


def context_overflow(target, prompt_len: int, max_new_tokens: int, tree) -> str | None:
    """Why a prompt does not fit the target's context, or None when it does: the decoding loop's own rule
    (`decoding.checks.check_context`), so that evaluation skips exactly the prompts that the loop would refuse."""
    try:
        check_context(target, prompt_len, max_new_tokens, tree)
    except ValueError as err:
        return f"the prompt exceeds the target's context: {err}"
    return None


def run_questions(
    model,
    questions: list[Question],
    runners: dict[str, Runner],
    max_new_tokens: int,
    max_turns: int,
    tree,
    log_path: Path,
    progress=None,
    batch_size: int = 1,
) -> list[dict]:
    """Ask every turn (up to `max_turns`) of every question; returns one record per prompt.

    `tree` is the evaluated tree spec (for the context rule); prompts already in `log_path` are not run again (their
    answers still join the output store, in order). A prompt's reference answer joins the drafter's output store once
    every method has run it, so no method drafts from the answer it is generating. With `batch_size` B > 1, B
    questions are asked at once: turn n of each of them is one batch given to every method
    (`timing.run_batch_interleaved`), and their answers join the store once the batch is done.
    """
    done = {(r["question_id"], r["turn"]): r for r in load_records(log_path)}
    records = []
    with open(log_path, "a", encoding="utf-8") as log_file:
        for start in range(0, len(questions), batch_size):
            group = questions[start : start + batch_size]
            histories: list[list[dict]] = [[] for _ in group]
            asking = list(range(len(group)))  # the questions of the group still asked
            for turn in range(1, max_turns + 1):
                asking = [i for i in asking if turn <= len(group[i].turns)]
                if not asking:
                    break
                for i in asking:
                    histories[i].append({"role": "user", "content": group[i].turns[turn - 1]})
                asked = [(group[i], histories[i]) for i in asking]
                asked_records = ask(model, runners, asked, turn, done, len(records), max_new_tokens, tree, batch_size)
                for i, record in zip(list(asking), asked_records, strict=True):
                    if (record["question_id"], turn) not in done:
                        log_file.write(json.dumps(record) + "\n")
                        log_file.flush()
                    records.append(record)
                    if record.get("skipped"):
                        asking.remove(i)  # later turns would need this turn's answer
                        continue
                    # only now, every method having run this prompt, does its answer join the drafter's output store
                    model.drafter.remember(record[REFERENCE]["tokens"])
                    answer = model.tokenizer.decode(record[REFERENCE]["tokens"], skip_special_tokens=True)
                    histories[i].append({"role": "assistant", "content": answer})
                    if progress is not None:
                        progress.update(1)
    return records


def ask(
    model, runners, asked: list, turn: int, done: dict, rotation: int, max_new_tokens: int, tree, batch_size: int
) -> list[dict]:
    """One turn of the (question, history) pairs `asked`, one record each: those already in `done` as they were, the
    others through every method, alone at batch size 1 (`run_one`), else as one batch (`run_batch`)."""
    pending = [(q, h) for q, h in asked if (q.question_id, turn) not in done]
    if batch_size == 1 and pending:
        return [run_one(model, runners, pending[0][1], pending[0][0], turn, rotation, max_new_tokens, tree)]
    ran = iter(run_batch(model, runners, pending, turn, rotation, max_new_tokens, tree) if pending else [])
    return [done[q.question_id, turn] if (q.question_id, turn) in done else next(ran) for q, _ in asked]


def prompt_base(model, history, question, turn: int, max_new_tokens: int, tree) -> tuple[torch.Tensor, dict]:
    """A prompt's ids and its record's first fields; `skipped` says why when it cannot fit the target's context."""
    ids = model.chat_ids(history)
    base = {
        "question_id": question.question_id,
        "category": question.category,
        "turn": turn,
        "prompt_tokens": ids.shape[1],
    }
    reason = context_overflow(model.target, ids.shape[1], max_new_tokens, tree)
    if reason is not None:
        log.warning("question %s turn %d skipped: %s", question.question_id, turn, reason)
        base["skipped"] = reason
    return ids, base


def run_one(model, runners, history, question, turn: int, rotation: int, max_new_tokens: int, tree) -> dict:
    """One prompt through every method; a prompt that cannot fit the target's context is recorded as skipped."""
    ids, base = prompt_base(model, history, question, turn, max_new_tokens, tree)
    if base.get("skipped"):
        return base
    return {**base, "prompt_ids": ids[0].tolist(), **run_interleaved(runners, ids, max_new_tokens, rotation)}


def run_batch(model, runners, asked: list, turn: int, rotation: int, max_new_tokens: int, tree) -> list[dict]:
    """The prompts of (question, history) pairs `asked` through every method as one batch, a record each; a prompt
    that cannot fit the target's context is recorded as skipped and left out of the batch."""
    prompts = [prompt_base(model, history, question, turn, max_new_tokens, tree) for question, history in asked]
    fitting = [(ids, base) for ids, base in prompts if not base.get("skipped")]
    timed = run_batch_interleaved(runners, [ids for ids, _ in fitting], max_new_tokens, rotation) if fitting else []
    results = iter(timed)
    return [
        base if base.get("skipped") else {**base, "prompt_ids": ids[0].tolist(), **next(results)}
        for ids, base in prompts
    ]


def load_records(path: Path) -> list[dict]:
    """The prompts a previous (killed) run of this directory finished, from its prompts.jsonl. A last line that the
    kill cut short is removed from the file (its prompt runs again); every complete line must be a record."""
    if not path.exists():
        return []
    text = path.read_bytes()
    complete = text[: text.rfind(b"\n") + 1]
    if len(complete) < len(text):
        log.warning(
            "%s: dropping an incomplete last line (%d bytes) left by a killed run", path, len(text) - len(complete)
        )
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    return [record for _, record in read_jsonl(path)]
