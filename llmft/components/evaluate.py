"""Step 4: eval perplexity and the selected tasks (held-out generation, lm-eval tasks) of the base model and of
every complete checkpoint; with Langfuse, the base model, the previous champion and the new adapter answer the
same prompts side by side."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from llmft.components.images import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def evaluate_perplexity(
    plan: Input[Artifact],
    tokenized: Input[Dataset],
    run: Input[Model],
    evaluation: Output[Artifact],
    report: Output[HTML],
    metrics: Output[Metrics],
):
    """Evaluate the base model and each ``checkpoints/step-N`` with a COMPLETE marker.

    Uses the trainer's own token-weighted evaluation on the validation split, so the
    numbers match the ``eval_loss=`` / ``perplexity=`` lines the trainer prints. Then the plan's
    ``promote_eval_tasks`` on each model over the same load of the base (llmft/components/lib/evaluation/task_eval.py):
    ``heldout`` answers up to ``promote_eval_max_questions`` questions greedily (exact match, contains, token F1;
    evaluation.json's ``generations`` keeps the per-question table); shipped lm-eval tasks run offline.
    The best checkpoint is the best by ``promote_metric``.

    With Langfuse configured (the Secret named by ``langfuse_secret``), the base model, the
    previous champion (MLflow alias ``champion``) and the best checkpoint then answer a fixed
    prompt set from the validation split, recorded as Langfuse dataset runs with scores
    (llmft/components/lib/evaluation/comparison.py); evaluation.json's ``langfuse`` section links them.

    With MLflow configured, the numbers (base and every checkpoint, by step) and both files go to the pipeline
    run's ``evaluate-<run_id>`` child run (llmft/components/lib/registry/lineage.py).

    Outputs: ``evaluation`` (evaluation.json, read by the promote step), ``report`` (an HTML
    page with the loss and perplexity plot embedded as a PNG, shown in the KFP UI) and
    ``metrics`` (base and best eval loss / perplexity and every task metric, ``base_<metric>`` /
    ``best_<metric>``, and the gate's verdict: ``gate_promoted``, ``guard_<metric>``). evaluation.json also
    records what each task was scored on (``eval_sets``: hash, size, version) and the gate's decision with its
    reason (``gate``, the promote step's own rule over the same numbers).
    """
    import os

    from llmft.components.lib.plan.schema import read_plan
    from llmft.components.lib.step_exit import step_outcome
    from llmft.trainer.quiet import quiet_known_noise

    quiet_known_noise()  # the libraries' known noise off the task's log (llmft/trainer/quiet.py)

    with step_outcome("evaluate-perplexity"):  # a bad input or a full disk: one error: line, its exit code
        run_plan = read_plan(plan.path)
        run_plan.layout.use_hf_cache()  # before transformers is imported
        from llmft.components.lib.evaluation.checkpoints import (
            base_evaluator,
            eval_curve,
            evaluate_run,
            kfp_metrics,
            read_metrics_history,
            render_html,
        )
        from llmft.components.lib.evaluation.comparison import compare_in_langfuse
        from llmft.components.lib.evaluation.outputs import eval_sets, gate_preview, write_outputs
        from llmft.components.lib.evaluation.task_runner import task_runner

        run_dir = run.metadata["path"]
        # one load of the base (at the trainer's model.revision) for the perplexities, the tasks and the comparison
        evaluator = base_evaluator(run_plan.trainer.config.model)
        runner = task_runner(run_plan, evaluator, tokenized.metadata["path"])
        result = evaluate_run(
            run_dir,
            run_plan.trainer.model,
            tokenized.metadata["path"],
            evaluate_fn=evaluator,
            metric=run_plan.registry.promote_metric,
            task_fn=runner,
        )
        if runner is not None and runner.answers:
            result["generations"] = runner.table()
        result["eval_sets"] = eval_sets(result, runner, tokenized.metadata["path"])
        result["gate"] = gate_preview(result, run_plan)
        compared = compare_in_langfuse(
            result,
            run_dir=run_dir,
            base_model=run_plan.trainer.model,
            prepared_dir=run_plan.data.prepared_dir,
            tokenized_dir=tokenized.metadata["path"],
            model_name=run_plan.registry.model_name,
            run_id=run_plan.run_id,
            tracking_uri=run_plan.registry.tracking_uri,
            data_root=run_plan.layout.root,
            evaluator=evaluator,
        )
        if compared is not None:
            result["langfuse"] = compared

        history = read_metrics_history(os.path.join(run_dir, "metrics.jsonl"))
        result["curve"] = eval_curve(history)  # the trainer's evaluations at eval_every: perplexity per step
        page = render_html(result, history, title=f"Evaluation of {os.path.basename(run_dir)}")
        write_outputs(result, page, evaluation.path, report.path)  # a full disk: one line naming the path
        evaluation.metadata.update({"best": result["best"], "run_dir": run_dir})
        for name, value in kfp_metrics(result).items():
            metrics.log_metric(name, value)
        from llmft.components.lib.registry.lineage import record_evaluation  # MLflow: the pipeline run's evaluate child

        record_evaluation(run_plan, result, (os.path.join(evaluation.path, "evaluation.json"), report.path))
        best = next(c for c in result["checkpoints"] if c["name"] == result["best"])
        print(f"base perplexity {result['base']['perplexity']:.4f}; best {best['name']} {best['perplexity']:.4f}")
