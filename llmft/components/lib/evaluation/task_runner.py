"""Run the evaluate step's tasks (llmft/components/lib/evaluation/task_eval.py) on a model the evaluator has loaded.

:class:`TaskRunner` is called once per model (the base, then each checkpoint) with the evaluator that
scored its perplexity, so the tasks reuse that one load of the base: ``evaluator.applied(model, adapter)``
(llmft.trainer.evaluate.PerplexityEvaluator). Held-out generation answers greedily
(llmft/components/lib/evaluation/generations.py ``generate_answers``) and keeps every answer with its scores for the
per-question table; an lm-eval task runs in-process on the same model (lm_eval_tasks.py, beside this file).
Each task's wall time is recorded beside its scores (``seconds``): what the evaluation cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from llmft.components.lib.evaluation import generations as gen
from llmft.components.lib.evaluation.lm_eval_tasks import run_task
from llmft.components.lib.evaluation.task_eval import HELDOUT, Question, mean_scores, read_questions, score_answer
from llmft.trainer.data.loader import dataset_info


class TaskRunner:
    """Scores of each selected task for one model per call; :attr:`table` holds the held-out answers."""

    def __init__(
        self,
        evaluator,
        tokenizer,
        tasks: Sequence[str],
        questions: Sequence[Question | gen.Prompt],
        *,
        end_of_turn: str | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """``max_new_tokens``: generations.MAX_NEW_TOKENS (read per call) unless given."""
        self.evaluator, self.tokenizer, self.tasks = evaluator, tokenizer, tuple(tasks)
        self.questions = list(questions)
        self.end_of_turn, self.max_new_tokens = end_of_turn, max_new_tokens
        self.answers: dict[str, list[dict[str, Any]]] = {}

    def __call__(self, label: str, model_path: str, adapter_path: str | None = None) -> dict[str, dict[str, float]]:
        results: dict[str, dict[str, float]] = {}
        with self.evaluator.applied(model_path, adapter_path) as model:
            for task in self.tasks:
                started = time.perf_counter()
                scores = self._heldout(label, model) if task == HELDOUT else self._lm_eval(task, model)
                results[task] = {**scores, "seconds": round(time.perf_counter() - started, 2)}
                shown = " ".join(f"{k}={v:.4f}" for k, v in results[task].items())
                print(f"task {task} on {label}: {shown}", flush=True)
        return results

    def _heldout(self, label: str, model) -> dict[str, float]:
        if not self.questions:
            return {}
        texts = gen.generate_answers(
            model,
            self.tokenizer,
            self.questions,
            max_new_tokens=self.max_new_tokens or gen.MAX_NEW_TOKENS,
            end_of_turn=self.end_of_turn,
        )
        rows = [score_answer(text, q.reference) for text, q in zip(texts, self.questions, strict=True)]
        self.answers[label] = [{"text": text, **row} for text, row in zip(texts, rows, strict=True)]
        return {**mean_scores(rows), "questions": float(len(rows))}

    def _lm_eval(self, task: str, model) -> dict[str, float]:
        return run_task(task, model, self.tokenizer)

    def table(self) -> list[dict[str, Any]]:
        """One row per question: its prompt, reference and every model's answer with its scores."""
        return [
            {
                "id": q.id,
                "question": q.messages[-1]["content"],
                "reference": q.reference,
                "answers": {label: answers[i] for label, answers in self.answers.items()},
            }
            for i, q in enumerate(self.questions)
        ]


def task_runner(plan, evaluator, tokenized_dir: str) -> TaskRunner | None:
    """The evaluate step's runner of ``plan.evaluation`` (None when no task is selected): questions from
    ``promote_eval_questions`` or the validation split, the tokenizer and end-of-turn the data was tokenized with."""
    settings = plan.evaluation
    if not settings.tasks:
        return None
    if settings.questions:
        questions: list = read_questions(settings.questions, settings.max_questions)
    else:
        questions = gen.prompt_set(plan.data.prepared_dir, settings.max_questions)
    manifest = dataset_info(tokenized_dir)
    tokenizer = gen.generation_tokenizer(plan.trainer.model, manifest)
    return TaskRunner(evaluator, tokenizer, settings.tasks, questions, end_of_turn=manifest.get("end_of_turn"))
