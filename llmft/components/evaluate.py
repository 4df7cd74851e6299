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
    from llmft.components.lib.contracts.schema import read_plan
    from llmft.components.lib.step_exit import step_outcome
    from llmft.trainer.quiet import quiet_known_noise

    quiet_known_noise()  # the libraries' known noise off the task's log (llmft/trainer/quiet.py)

    with step_outcome("evaluate-perplexity"):  # a bad input or a full disk: one error: line, its exit code
        run_plan = read_plan(plan.path)
        run_plan.layout.use_hf_cache()  # before transformers is imported
        from llmft.components.lib.evaluation.checkpoints import kfp_metrics
        from llmft.components.lib.evaluation.evaluate_step import evaluate_step, evaluation_line

        run_dir = run.metadata["path"]
        result = evaluate_step(run_plan, run_dir, tokenized.metadata["path"], evaluation.path, report.path)
        evaluation.metadata.update({"best": result["best"], "run_dir": run_dir})
        for name, value in kfp_metrics(result).items():
            metrics.log_metric(name, value)
        print(evaluation_line(result))
