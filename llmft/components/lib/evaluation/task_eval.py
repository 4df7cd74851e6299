"""What the evaluate step scores besides perplexity, and how a score is compared: no torch here (the plan
step validates ``promote_eval_tasks`` / ``promote_metric`` / ``promote_guards`` in the pipeline image).

Tasks (pipeline parameter ``promote_eval_tasks``, comma-separated; ``''`` = perplexity only):

* ``heldout``: held-out generation. Questions with reference answers (the validation split's last
  assistant turns, or the JSONL file ``promote_eval_questions`` on the volume, questions.py) are answered greedily
  by the base model and by every checkpoint; each answer is scored by scoring.py (SQuAD v1.1 exact match and token F1,
  whole-word ``contains``; the best over several references); the metrics are the means over the questions.
* an lm-evaluation-harness task (lm_eval_tasks.py): shipped in llmft/demo/lm_eval_tasks/, a task YAML
  on the volume (a path ending in ``.yaml``), or any task, group or tag of lm-eval's registry (its data from
  the volume's cache, eval_cache.py, or a reachable hub).

A metric is named ``<task>.<metric>`` (``heldout.contains``, ``arc_easy.acc``); perplexities are
lower-is-better, every other metric higher-is-better. ``promote_metric`` names the one the promote gate, the
best checkpoint and the registry's champion follow (:func:`beats`); ``promote_guards`` the ones the adapter may
not lose (:func:`parse_guards`).
"""

from __future__ import annotations

import math
from pathlib import Path

from llmft.demo import LM_EVAL_TASK_DIR
from llmft.trainer.errors import ConfigError

HELDOUT = "heldout"
MAX_TASKS = 64
MAX_TASK_CHARS = 200
DEFAULT_MAX_QUESTIONS = 16
"""Held-out questions per model by default: cheap enough for every run (bounded by ``promote_eval_max_questions``)."""


def lm_eval_task_names(task_dir: Path = LM_EVAL_TASK_DIR) -> tuple[str, ...]:
    """The ``task:`` names of the shipped lm-eval task YAMLs (the file stem, by convention checked in tests)."""
    return tuple(sorted(p.stem for p in task_dir.glob("*.yaml"))) if task_dir.is_dir() else ()


def shown(text: str, limit: int = 80) -> str:
    """``text`` for an error line: at most ``limit`` characters (a 100 KB value is not echoed whole)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def parse_tasks(text: str) -> tuple[str, ...]:
    """``promote_eval_tasks`` -> entries in order, duplicates dropped; ConfigError on an entry no task can have
    (the plan step then finds each one: task_plan.py)."""
    if len(text) > MAX_TASKS * MAX_TASK_CHARS:
        raise ConfigError(
            f"pipeline parameter `promote_eval_tasks`={shown(text)}: too long; name at most {MAX_TASKS} tasks"
        )
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if len(names) > MAX_TASKS:
        raise ConfigError(f"pipeline parameter `promote_eval_tasks`: {len(names)} tasks; name at most {MAX_TASKS}")
    for name in names:
        if len(name) > MAX_TASK_CHARS or any(c.isspace() or not c.isprintable() for c in name):
            raise ConfigError(
                f"pipeline parameter `promote_eval_tasks`: {shown(name)} is not a task name or a task file's path; use "
                "heldout, lm-eval task, group or tag names, or /data/.../task.yaml, comma-separated"
            )
    return names


def check_promote_metric(metric: str, available: tuple[str, ...], open_tasks: tuple[str, ...] = ()) -> str:
    """``promote_metric`` must be perplexity or a metric a selected task computes (``open_tasks``: tasks whose
    metrics are known only when they run, any of whose ``<task>.<name>`` is accepted)."""
    if metric in available or metric.partition(".")[0] in open_tasks:
        return metric
    raise ConfigError(
        f"pipeline parameter `promote_metric`={shown(metric)}: not a metric this run computes; use one of "
        f"{', '.join(available)} (a task metric needs its task in `promote_eval_tasks`)"
    )


def parse_guards(
    text: str, available: tuple[str, ...], open_tasks: tuple[str, ...] = ()
) -> tuple[tuple[str, float], ...]:
    """``promote_guards`` (``arc_easy.acc:0.02,heldout.token_f1``; a tolerance in the metric's units, default
    :data:`DEFAULT_GUARD_TOLERANCE`) -> (metric, tolerance) pairs; ConfigError naming a bad one."""
    guards = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        metric, _, raw = part.partition(":")
        try:
            tolerance = float(raw) if raw.strip() else DEFAULT_GUARD_TOLERANCE
        except ValueError:
            tolerance = -1.0
        if not (math.isfinite(tolerance) and 0 <= tolerance < 1):
            raise ConfigError(
                f"pipeline parameter `promote_guards`: {shown(part)}: the tolerance after ':' must be a number in "
                "[0, 1), e.g. arc_easy.acc:0.02 (two points) or perplexity:0.05 (5%)"
            )
        try:
            check_promote_metric(metric.strip(), available, open_tasks)
        except ConfigError:
            raise ConfigError(
                f"pipeline parameter `promote_guards`: {shown(metric)} is not a metric this run computes; use one of "
                f"{', '.join(available)}"
            ) from None
        guards.append((metric.strip(), tolerance))
    return tuple(guards)


DEFAULT_GUARD_TOLERANCE = 0.01
"""A guard's tolerance when ``promote_guards`` gives none: one point of a score, 1% of a perplexity."""
