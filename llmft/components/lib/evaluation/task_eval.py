"""What the evaluate step scores besides perplexity, and how a score is compared: no torch here (the plan
step validates ``promote_eval_tasks`` / ``promote_metric`` in the pipeline image).

Tasks (pipeline parameter ``promote_eval_tasks``, comma-separated; ``''`` = perplexity only):

* ``heldout``: held-out generation. Questions with reference answers (the validation split's last
  assistant turns, or the JSONL file ``promote_eval_questions`` on the volume: ``{"question": ..., "answer": ...}``
  per line) are answered greedily by the base model and by every checkpoint; each answer is scored by
  ``exact_match`` (normalized equality), ``contains`` (the normalized reference appears in the answer)
  and ``token_f1`` (SQuAD-style token overlap F1); the metrics are the means over the questions.
* an lm-evaluation-harness task shipped in llmft/trainer/assets/lm_eval_tasks/ (its YAML's ``task:`` name),
  run offline on local JSON data (llmft/components/lib/evaluation/lm_eval_tasks.py).

A metric is named ``<task>.<metric>`` (``heldout.contains``); ``perplexity`` is lower-is-better, every
task metric higher-is-better. ``promote_metric`` names the one the promote gate, the best checkpoint and
the registry's champion follow (:func:`beats`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from llmft.trainer.errors import ConfigError, DataError

PERPLEXITY = "perplexity"
HELDOUT = "heldout"
HELDOUT_METRICS = ("exact_match", "contains", "token_f1")
LM_EVAL_TASK_DIR = Path(__file__).resolve().parents[3] / "trainer" / "assets" / "lm_eval_tasks"  # llmft/trainer/...
"""The lm-eval task YAMLs shipped with the package (their data beside them, as JSON Lines)."""
LM_EVAL_METRICS = ("acc",)
"""The lm-eval metrics a shipped task reports (multiple-choice accuracy)."""
DEFAULT_MAX_QUESTIONS = 16
"""Held-out questions per model by default: cheap enough for every run (bounded by ``promote_eval_max_questions``)."""


def lm_eval_task_names(task_dir: Path = LM_EVAL_TASK_DIR) -> tuple[str, ...]:
    """The ``task:`` names of the shipped lm-eval task YAMLs (the file stem, by convention checked in tests)."""
    return tuple(sorted(p.stem for p in task_dir.glob("*.yaml"))) if task_dir.is_dir() else ()


def known_tasks() -> tuple[str, ...]:
    return (HELDOUT, *lm_eval_task_names())


def parse_tasks(text: str) -> tuple[str, ...]:
    """``promote_eval_tasks`` -> task names in order, duplicates dropped; ConfigError naming an unknown one."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    known = known_tasks()
    for name in names:
        if name not in known:
            raise ConfigError(
                f"pipeline parameter `promote_eval_tasks`: unknown task {name!r}; use a comma-separated list of "
                f"{', '.join(known)} (or '' for perplexity only)"
            )
    return names


def task_metrics(tasks: tuple[str, ...]) -> tuple[str, ...]:
    """Every metric name the tasks produce (perplexity first)."""
    names = [PERPLEXITY]
    for task in tasks:
        metrics = HELDOUT_METRICS if task == HELDOUT else LM_EVAL_METRICS
        names += [f"{task}.{m}" for m in metrics]
    return tuple(names)


def check_promote_metric(metric: str, tasks: tuple[str, ...]) -> str:
    """``promote_metric`` must be perplexity or a metric of a selected task."""
    available = task_metrics(tasks)
    if metric not in available:
        raise ConfigError(
            f"pipeline parameter `promote_metric`={metric!r}: not a metric this run computes; use one of "
            f"{', '.join(available)} (a task metric needs its task in `promote_eval_tasks`)"
        )
    return metric


def lower_is_better(metric: str) -> bool:
    return metric == PERPLEXITY


def metric_value(result: dict, metric: str) -> float | None:
    """The value of ``metric`` in a model's evaluation entry (``perplexity`` or ``tasks.<task>.<metric>``)."""
    if metric == PERPLEXITY:
        value = result.get(PERPLEXITY)
    else:
        task, _, name = metric.partition(".")
        value = ((result.get("tasks") or {}).get(task) or {}).get(name)
    return None if value is None else float(value)


def threshold(base: float, metric: str, margin: float) -> float:
    """What a candidate must beat: perplexity below ``base * (1 - margin)`` (relative); a task score (0..1)
    above ``base + margin`` (absolute points: 0.01 = one point)."""
    return base * (1.0 - margin) if lower_is_better(metric) else base + margin


def beats(value: float, base: float, metric: str, margin: float) -> bool:
    limit = threshold(base, metric, margin)
    return value < limit if lower_is_better(metric) else value > limit


def rank_key(result: dict, metric: str) -> tuple[float, float, int]:
    """Sort key, best first: the metric (its direction), then lower perplexity, then the later step."""
    value = metric_value(result, metric)
    value = float("inf") if value is None else (value if lower_is_better(metric) else -value)
    return value, float(result.get(PERPLEXITY, float("inf"))), -int(result.get("step") or 0)


def best_of(checkpoints: list[dict], metric: str) -> dict:
    return min(checkpoints, key=lambda c: rank_key(c, metric))


# ----------------------------------------------------------------------------- scoring


def normalize(text: str) -> str:
    """Case-folded, punctuation to spaces, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.casefold()).split())


def score_answer(answer: str, reference: str) -> dict[str, float]:
    """exact_match, contains and token_f1 of one answer against its reference."""
    got, want = normalize(answer), normalize(reference)
    return {
        "exact_match": float(got == want),
        "contains": float(bool(want) and want in got),
        "token_f1": _f1(got, want),
    }


def _f1(answer: str, reference: str) -> float:
    got, want = answer.split(), reference.split()
    common = sum((Counter(got) & Counter(want)).values())
    if not got or not want or not common:
        return float(got == want)
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


def mean_scores(rows: list[dict[str, float]]) -> dict[str, float]:
    return {m: sum(r[m] for r in rows) / len(rows) for m in HELDOUT_METRICS} if rows else {}


# ----------------------------------------------------------------------------- questions


@dataclass(frozen=True)
class Question:
    id: str
    messages: list
    """The prompt: a conversation without its answer."""
    reference: str


def read_questions(path: str | Path, limit: int) -> list[Question]:
    """The first ``limit`` questions of a JSONL file of ``{"question": str, "answer": str}`` (optionally
    ``"system": str``); DataError naming the file, line and field of a bad row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: eval_questions file not found; give a JSONL file on the volume or ''")
    questions: list[Question] = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if len(questions) >= limit:
                break
            if line.strip():
                questions.append(_question(path, number, line))
    if not questions:
        raise DataError(f"{path}: no question in the file; write one JSON object per line with question and answer")
    return questions


def _question(path: Path, number: int, line: str) -> Question:
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not JSON ({exc.msg}); write one JSON object per line") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object with question and answer")
    for field in ("question", "answer"):
        if not isinstance(row.get(field), str) or not row[field].strip():
            raise DataError(f'{where}: field `{field}` must be a non-empty string, e.g. {{"{field}": "..."}}')
    if "system" in row and not isinstance(row["system"], str):
        raise DataError(f"{where}: field `system` must be a string")
    messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + [
        {"role": "user", "content": row["question"]}
    ]
    return Question(f"{number}", messages, row["answer"])
