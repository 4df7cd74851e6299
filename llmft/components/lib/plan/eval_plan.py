"""The evaluate step's plan (``EvalPlan``) from the pipeline parameters: ``promote_eval_tasks`` (each task found by
lib/evaluation/task_plan.py ``resolve_task``), ``promote_metric`` and ``promote_guards``, the questions file, the
lm-eval settings. Part of the plan builder (build.py), not of evaluation/: it reads the pipeline parameters, which
live here, one layer above (issue 48)."""

from __future__ import annotations

from collections.abc import Mapping

from llmft.components.lib.contracts.metrics import PERPLEXITY
from llmft.components.lib.contracts.schema import DataLayout, EvalPlan, Guard
from llmft.components.lib.evaluation.questions import read_questions
from llmft.components.lib.evaluation.task_eval import HELDOUT, check_promote_metric, parse_guards, parse_tasks
from llmft.components.lib.evaluation.task_plan import resolve_task
from llmft.components.lib.plan.parameters import PipelineParameters
from llmft.trainer.errors import ConfigError

MAX_QUESTIONS = 1000
"""Upper bound of ``promote_eval_max_questions``: generation per model and checkpoint stays bounded."""
MAX_BATCH_SIZE = 1024


def eval_plan(p: PipelineParameters, layout: DataLayout, environ: Mapping[str, str]) -> EvalPlan:
    """``promote_eval_tasks`` (each found: :func:`resolve_task`), ``promote_metric`` and ``promote_guards``
    (metrics they compute), the questions file (every row, bounded by the run's context), and the lm-eval settings."""
    specs = tuple(resolve_task(name, layout.eval_cache, environ) for name in parse_tasks(p.promote_eval_tasks))
    available = (PERPLEXITY, *(f"{s.label}.{m}" for s in specs for m in s.metrics))
    open_tasks = tuple(s.label for s in specs if not s.metrics)
    check_promote_metric(p.promote_metric, available, open_tasks)
    guards = tuple(Guard(m, t) for m, t in parse_guards(p.promote_guards, available, open_tasks))
    _check_range("promote_eval_max_questions", p.promote_eval_max_questions, 1, MAX_QUESTIONS)
    _check_range("promote_eval_num_fewshot", p.promote_eval_num_fewshot, -1, 64)
    _check_range("promote_eval_limit", p.promote_eval_limit, 0, 10_000_000)
    _check_range("promote_eval_batch_size", p.promote_eval_batch_size, 1, MAX_BATCH_SIZE)
    if p.promote_eval_questions:
        if HELDOUT not in (s.name for s in specs):
            raise ConfigError(
                "pipeline parameter `promote_eval_questions` is set but `promote_eval_tasks` lacks heldout: add it"
            )
        read_questions(
            p.promote_eval_questions, p.promote_eval_max_questions, max_length=p.finetune_max_length
        )  # file, line, field
    return EvalPlan(
        tasks=tuple(s.label for s in specs),
        questions=p.promote_eval_questions,
        max_questions=p.promote_eval_max_questions,
        specs=specs,
        cache_dir=layout.eval_cache,
        num_fewshot=p.promote_eval_num_fewshot,
        limit=p.promote_eval_limit,
        batch_size=p.promote_eval_batch_size,
        guards=guards,
    )


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(f"pipeline parameter `{name}`={value}: must be between {low} and {high}")
