"""The evaluate step's body (llmft/components/evaluate.py only calls it): one load of the base model (at the
trainer's ``model.revision``) for the perplexities, the tasks and the Langfuse comparison; every complete
checkpoint scored; what each metric was scored on; the gate's preview; the trainer's eval curve; evaluation.json
and the HTML report written whole; the numbers recorded in the pipeline run's MLflow ``evaluate`` child run.

Call it after ``run_plan.layout.use_hf_cache()``: the base model's load imports transformers."""

from __future__ import annotations

import os
from typing import Any

from llmft.components.lib.contracts.metrics import read_metrics_history
from llmft.components.lib.contracts.schema import RunPlan
from llmft.components.lib.evaluation.checkpoints import base_evaluator, eval_curve, evaluate_run, render_html
from llmft.components.lib.evaluation.comparison import compare_in_langfuse
from llmft.components.lib.evaluation.outputs import eval_sets, gate_preview, write_outputs
from llmft.components.lib.evaluation.task_runner import task_runner
from llmft.components.lib.registry.lineage import record_evaluation


def evaluate_step(run_plan: RunPlan, run_dir: str, tokenized_dir: str, evaluation_dir: str, report_path: str) -> dict:
    """Score the base model and every complete checkpoint of ``run_dir``; write ``evaluation_dir``/evaluation.json
    and the report at ``report_path``; return the evaluation (what evaluation.json holds)."""
    evaluator = base_evaluator(run_plan.trainer.config.model)
    runner = task_runner(run_plan, evaluator, tokenized_dir)
    metric = run_plan.registry.promote_metric
    result = evaluate_run(
        run_dir, run_plan.trainer.model, tokenized_dir, evaluate_fn=evaluator, metric=metric, task_fn=runner
    )
    if runner is not None and runner.answers:
        result["generations"] = runner.table()
    result["eval_sets"] = eval_sets(result, runner, tokenized_dir)
    result["gate"] = gate_preview(result, run_plan)
    compared = _compare(run_plan, result, run_dir, tokenized_dir, evaluator)
    if compared is not None:
        result["langfuse"] = compared
    history = read_metrics_history(os.path.join(run_dir, "metrics.jsonl"))
    result["curve"] = eval_curve(history)  # the trainer's evaluations at eval_every: perplexity per step
    page = render_html(result, history, title=f"Evaluation of {os.path.basename(run_dir)}")
    write_outputs(result, page, evaluation_dir, report_path)  # a full disk: one line naming the path
    record_evaluation(run_plan, result, (os.path.join(evaluation_dir, "evaluation.json"), report_path))
    return result


def _compare(run_plan: RunPlan, result: dict, run_dir: str, tokenized_dir: str, evaluator) -> dict[str, Any] | None:
    """With Langfuse: the base model, the previous champion and the best checkpoint answer the same prompts."""
    return compare_in_langfuse(
        result,
        run_dir=run_dir,
        base_model=run_plan.trainer.model,
        prepared_dir=run_plan.data.prepared_dir,
        tokenized_dir=tokenized_dir,
        model_name=run_plan.registry.model_name,
        run_id=run_plan.run_id,
        tracking_uri=run_plan.registry.tracking_uri,
        data_root=run_plan.layout.root,
        evaluator=evaluator,
    )


def evaluation_line(result: dict) -> str:
    """The step's last log line: the base model's perplexity and the best checkpoint's."""
    best = next(c for c in result["checkpoints"] if c["name"] == result["best"])
    return f"base perplexity {result['base']['perplexity']:.4f}; best {best['name']} {best['perplexity']:.4f}"
