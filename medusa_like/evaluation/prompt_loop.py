"""The evaluation's prompt loop: every turn of every question through every method, resumable.

Turn n of a question carries the reference's answers to turns 1..n-1. Each prompt's result is appended to a JSON Lines
log (`prompts.jsonl`) as soon as it is measured, so a killed run keeps what it did; a later run with the same log skips
the prompts already there. A prompt that cannot fit the target's context is recorded as skipped.
"""

import json
import logging
from pathlib import Path

from medusa_like.decoding.checks import check_context
from medusa_like.evaluation.methods import REFERENCE
from medusa_like.evaluation.questions import Question
from medusa_like.evaluation.timing import Runner, run_interleaved
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
) -> list[dict]:
    """Ask every turn (up to `max_turns`) of every question; returns one record per prompt, in order.

    `tree` is the evaluated tree spec (for the context rule); prompts already in `log_path` are not run again (their
    answers still join the output store, in order). A prompt's reference answer joins the drafter's output store once
    every method has run it, so no method drafts from the answer it is generating.
    """
    done = {(r["question_id"], r["turn"]): r for r in load_records(log_path)}
    records = []
    with open(log_path, "a", encoding="utf-8") as log_file:
        for question in questions:
            history: list[dict] = []
            for turn, text in enumerate(question.turns[:max_turns], 1):
                history.append({"role": "user", "content": text})
                key = (question.question_id, turn)
                if key in done:
                    record = done[key]
                else:
                    record = run_one(model, runners, history, question, turn, len(records), max_new_tokens, tree)
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                records.append(record)
                if record.get("skipped"):
                    break  # later turns would need this turn's answer
                # only now, every method having run this prompt, does its answer join the drafter's output store
                model.drafter.remember(record[REFERENCE]["tokens"])
                answer = model.tokenizer.decode(record[REFERENCE]["tokens"], skip_special_tokens=True)
                history.append({"role": "assistant", "content": answer})
                if progress is not None:
                    progress.update(1)
    return records


def run_one(model, runners, history, question, turn: int, rotation: int, max_new_tokens: int, tree) -> dict:
    """One prompt through every method; a prompt that cannot fit the target's context is recorded as skipped."""
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
        return {**base, "skipped": reason}
    return {**base, "prompt_ids": ids[0].tolist(), **run_interleaved(runners, ids, max_new_tokens, rotation)}


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
