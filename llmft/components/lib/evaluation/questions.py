"""The held-out questions file (pipeline parameter ``promote_eval_questions``): read by the plan step (every row
checked, seconds, no tokenizer) and by the evaluate step.

One JSON object per line: ``{"question": str, "answer": str | [str, ...]}`` (several references: the best
match counts, scoring.py), optionally ``"system": str``. Anything else is one line naming the file, the line and
the fix, as prepare says it (llmft/trainer/data/sources.py): a link (prepare refuses links too), a directory or a
FIFO, text that is not UTF-8 (Latin-1, binary, UTF-16), a row nested too deep, a key written twice, a reference
that normalises to nothing, and a question longer than the run's context can hold (bounded by characters:
:data:`MAX_CHARS_PER_TOKEN` per token of ``max_length``; the evaluate step then bounds the prompt in tokens).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from llmft.components.lib.evaluation.scoring import scorable
from llmft.trainer.data.sources import _refuse_not_utf8, _refuse_utf16_or_32
from llmft.trainer.errors import DataError
from llmft.trainer.safe_files import describe_mode, open_file

MAX_CHARS_PER_TOKEN = 8
"""Where no tokenizer is at hand, a question of more than this many characters per token of the run's
``max_length`` cannot fit its context (English text averages about 4 characters per token)."""


@dataclass(frozen=True)
class Question:
    id: str
    messages: list
    """The prompt: a conversation without its answer."""
    references: tuple[str, ...]
    """Every acceptable answer (scoring.score_answer takes the best)."""

    @property
    def reference(self) -> str:
        """The references as one line (the report's and Langfuse's ``expected output``)."""
        return " | ".join(self.references)


def read_questions(path: str | Path, limit: int, *, max_length: int | None = None) -> list[Question]:
    """The first ``limit`` questions of the file; DataError naming file, line and field of a bad row, or the file
    when it is not a regular file. ``max_length``: the run's context in tokens (bounds each question)."""
    path = Path(path)
    _check_regular_file(path)
    questions: list[Question] = []
    max_chars = None if max_length is None else max_length * MAX_CHARS_PER_TOKEN
    with open_file(path, path.parent) as fh:
        for number, raw in enumerate(fh, 1):
            if len(questions) >= limit:
                break
            if number == 1:
                _refuse_utf16_or_32(raw, str(path))
            _refuse_not_utf8(raw, str(path), number)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:  # a character cut at the end of the file
                raise DataError(f"{path}:{number}: not UTF-8 text ({exc.reason}); save the file as UTF-8") from None
            if line.strip():
                questions.append(_question(f"{path}:{number}", number, line, max_chars))
    if not questions:
        raise DataError(f"{path}: no question in the file; write one JSON object per line with question and answer")
    return questions


def _check_regular_file(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise DataError(
            f"{path}: promote_eval_questions file not found; give a JSONL file on the volume or ''"
        ) from None
    if stat.S_ISLNK(mode):
        raise DataError(
            f"{path}: promote_eval_questions is a symlink (to {os.readlink(path)}); links are not followed (as prepare "
            "refuses them): give the file itself"
        )
    if not stat.S_ISREG(mode):
        raise DataError(
            f"{path}: promote_eval_questions is {describe_mode(mode)}, not a regular file; give a JSONL file"
        )


def _no_duplicates(where: str):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        seen: dict[str, object] = {}
        for key, value in pairs:
            if key in seen:
                raise DataError(f"{where}: key `{key}` written twice in one row; keep one")
            seen[key] = value
        return seen

    return hook


def _question(where: str, number: int, line: str, max_chars: int | None) -> Question:
    try:
        row = json.loads(line, object_pairs_hook=_no_duplicates(where))
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not JSON ({exc.msg}); write one JSON object per line") from None
    except RecursionError:
        raise DataError(f"{where}: the row is nested too deep; write a flat object with question and answer") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object with question and answer")
    if not isinstance(row.get("question"), str) or not row["question"].strip():
        raise DataError(f'{where}: field `question` must be a non-empty string, e.g. {{"question": "..."}}')
    if "system" in row and not isinstance(row["system"], str):
        raise DataError(f"{where}: field `system` must be a string")
    references = _references(where, row.get("answer"))
    size = len(row["question"]) + len(row.get("system") or "")
    if max_chars is not None and size > max_chars:
        raise DataError(
            f"{where}: field `question` is {size:,} characters, more than the run's context holds "
            f"(finetune_max_length x {MAX_CHARS_PER_TOKEN} = {max_chars:,} characters); shorten it or raise "
            "finetune_max_length"
        )
    messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + [
        {"role": "user", "content": row["question"]}
    ]
    return Question(f"{number}", messages, references)


def _references(where: str, answer: object) -> tuple[str, ...]:
    answers = [answer] if isinstance(answer, str) else answer
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise DataError(
            f'{where}: field `answer` must be a non-empty string or a list of them, e.g. {{"answer": "..."}} or '
            '{"answer": ["...", "..."]}'
        )
    for text in answers:
        if not scorable(text):
            raise DataError(
                f"{where}: field `answer` {text[:40]!r} is only punctuation and articles once normalised: no answer "
                "can match it; write the words of the answer"
            )
    return tuple(answers)
