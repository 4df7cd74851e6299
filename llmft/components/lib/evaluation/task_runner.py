"""Run the evaluate step's tasks (llmft/components/lib/evaluation/task_eval.py) on a model the evaluator has loaded.

:class:`TaskRunner` is called once per model (the base, then each checkpoint) with the evaluator that
scored its perplexity, so the tasks reuse that one load of the base: ``evaluator.applied(model, adapter)``
(llmft.trainer.evaluate.PerplexityEvaluator). Held-out generation answers greedily
(llmft/components/lib/evaluation/generations.py ``generate_answers``) and keeps every answer with its scores for the
per-question table; an lm-eval task runs in-process on the same model (lm_eval_tasks.py, beside this file).
Each task's wall time is recorded beside its scores (``seconds``): what the evaluation cost.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from llmft.components.lib.contracts.schema import EvalPlan, EvalTaskPlan
from llmft.components.lib.evaluation import generations as gen
from llmft.components.lib.evaluation.lm_eval_tasks import run_tasks
from llmft.components.lib.evaluation.questions import Question, read_questions
from llmft.components.lib.evaluation.scoring import mean_scores, score_answer
from llmft.components.lib.evaluation.task_eval import HELDOUT
from llmft.trainer.data.loader import dataset_info


class TaskRunner:
    """Scores of each selected task for one model per call; :attr:`table` holds the held-out answers."""

    def __init__(
        self,
        evaluator,
        tokenizer,
        tasks: Sequence[EvalTaskPlan],
        questions: Sequence[Question | gen.Prompt],
        *,
        end_of_turn: str | None = None,
        settings: EvalPlan | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        """``settings``: the plan's lm-eval settings and generation bounds (EvalPlan's defaults unless given);
        ``max_prompt_tokens``: the longest prompt a held-out question may be (its start is cut beyond)."""
        self.evaluator, self.tokenizer, self.tasks = evaluator, tokenizer, tuple(tasks)
        self.questions = list(questions)
        self.end_of_turn, self.settings = end_of_turn, settings or EvalPlan()
        self.max_prompt_tokens = max_prompt_tokens
        self.answers: dict[str, list[dict[str, Any]]] = {}

    def __call__(self, label: str, model_path: str, adapter_path: str | None = None) -> dict[str, dict[str, float]]:
        results: dict[str, dict[str, float]] = {}
        with self.evaluator.applied(model_path, adapter_path) as model:
            for task in self.tasks:
                started = time.perf_counter()
                scores = self._heldout(label, model) if task.kind == HELDOUT else self._lm_eval(task, model)
                results[task.label] = {**scores, "seconds": round(time.perf_counter() - started, 2)}
                shown = " ".join(f"{k}={v:.4f}" for k, v in results[task.label].items())
                print(f"task {task.label} on {label}: {shown}", flush=True)
        return results

    def _heldout(self, label: str, model) -> dict[str, float]:
        if not self.questions:
            return {}
        texts = gen.generate_answers(
            model,
            self.tokenizer,
            self.questions,
            max_new_tokens=self.settings.max_new_tokens,
            end_of_turn=self.end_of_turn,
            max_prompt_tokens=self.max_prompt_tokens,
            max_time_s=self.settings.generation_timeout_s,
        )
        rows = [score_answer(text, q.references) for text, q in zip(texts, self.questions, strict=True)]
        self.answers[label] = [{"text": text, **row} for text, row in zip(texts, rows, strict=True)]
        return {**mean_scores(rows), "questions": float(len(rows))}

    def _lm_eval(self, task: EvalTaskPlan, model) -> dict[str, float]:
        s = self.settings
        return run_tasks(
            task, model, self.tokenizer, cache_dir=s.cache_dir, num_fewshot=s.num_fewshot, limit=s.limit,
            batch_size=s.batch_size,
        )  # fmt: skip

    def table(self) -> list[dict[str, Any]]:
        """One row per question: its prompt, reference(s) and every model's answer with its scores."""
        return [
            {
                "id": q.id,
                "question": q.messages[-1]["content"],
                "reference": q.reference,
                "answers": {label: answers[i] for label, answers in self.answers.items()},
            }
            for i, q in enumerate(self.questions)
        ]

    def eval_sets(self) -> dict[str, dict[str, Any]]:
        """What each task was scored on (evaluation.json ``eval_sets``; the registry compares only like with
        like): the questions' hash and count for heldout; the data's hash, size, version and lm-eval settings."""
        sets: dict[str, dict[str, Any]] = {}
        for task in self.tasks:
            if task.kind == HELDOUT:
                body = json.dumps([[q.messages, list(q.references)] for q in self.questions], sort_keys=True)
                sets[task.label] = {"hash": hashlib.sha256(body.encode()).hexdigest(), "size": len(self.questions)}
                continue
            s = self.settings
            sets[task.label] = {
                "hash": task.data_hash, "size": task.size, "version": task.version, "num_fewshot": s.num_fewshot,
                "limit": s.limit,
            }  # fmt: skip
        return sets


def task_runner(plan, evaluator, tokenized_dir: str) -> TaskRunner | None:
    """The evaluate step's runner of ``plan.evaluation`` (None when no task is selected): questions from
    ``promote_eval_questions`` or the validation split, the tokenizer and end-of-turn the data was tokenized with."""
    settings = plan.evaluation
    if not settings.specs:
        return None
    max_length = plan.data.max_length
    if settings.questions:
        questions: list = read_questions(settings.questions, settings.max_questions, max_length=max_length)
    else:
        questions = gen.prompt_set(plan.data.prepared_dir, settings.max_questions)
    manifest = dataset_info(tokenized_dir)
    tokenizer = gen.generation_tokenizer(plan.trainer.model, manifest)
    return TaskRunner(
        evaluator, tokenizer, settings.specs, questions, end_of_turn=manifest.get("end_of_turn"), settings=settings,
        max_prompt_tokens=max(max_length - settings.max_new_tokens, 1),
    )  # fmt: skip
