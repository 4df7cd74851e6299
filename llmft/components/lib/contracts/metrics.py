"""Metric definitions every concern reads: a metric's name (``perplexity``, ``<task>.<metric>``), its direction
(perplexities fall as a model improves, every other score rises), how a candidate beats a base, how checkpoints
rank; a model's task scores in evaluation.json; the trainer's ``metrics.jsonl`` rows. The evaluate step writes
them, the promote gate and the registry's champion compare by them, the train step's loss curve reads them: they
lived in evaluation/ until issue 48, which the registry (below it) then had to import back."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PERPLEXITY = "perplexity"
LOWER_IS_BETTER = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
"""Metric names (the part after the task) that fall as a model improves: lm-eval's perplexities."""


def lower_is_better(metric: str) -> bool:
    return metric.rpartition(".")[2] in LOWER_IS_BETTER


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
    """Sort key, best first: the metric (its direction), then lower perplexity, then the later step. A missing or
    non-finite value (a NaN in a hand-made evaluation.json) ranks last, whatever the order."""
    value = metric_value(result, metric)
    value = (
        float("inf") if value is None or not math.isfinite(value) else (value if lower_is_better(metric) else -value)
    )
    perplexity = result.get(PERPLEXITY)
    perplexity = float(perplexity) if isinstance(perplexity, int | float) and math.isfinite(perplexity) else math.inf
    return value, perplexity, -int(result.get("step") or 0)


def best_of(checkpoints: list[dict], metric: str) -> dict:
    return min(checkpoints, key=lambda c: rank_key(c, metric))


def task_scores(result: dict[str, Any]) -> dict[str, float]:
    """``<task>.<metric>`` -> value of one model's evaluation entry (no ``seconds``/``questions`` counts)."""
    return {
        f"{task}.{name}": float(value)
        for task, scores in (result.get("tasks") or {}).items()
        for name, value in scores.items()
        if name not in TASK_COUNTS
    }


TASK_COUNTS = ("seconds", "questions")
"""Keys of a task's entry that are not scores: its wall time and how many questions it asked."""


def read_metrics_history(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a trainer ``metrics.jsonl`` (missing file -> empty; bad lines are skipped)."""
    rows: list[dict[str, Any]] = []
    path = Path(path)
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows
