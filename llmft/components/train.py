"""Step 3: fine-tune on the plan's training backend (llmft/components/lib/jobs/backends.py): a PyTorchJob
(pytorchjob) or TrainJob on the cluster, or `llmft train` here (local)."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def train_model(
    plan: Input[Artifact],
    tokenized: Input[Dataset],
    run: Output[Model],
    metrics: Output[Metrics],
    loss_curve: Output[HTML],
    sweep_best: str = "",
):
    """Run the project's trainer on the tokenized shards and output the run directory.

    ``training_backend=pytorchjob`` builds the plan's PyTorchJob (Master + Workers running
    ``llmft train --nproc N --config <run_dir>/config.yaml data=<tokenized>``: the config the plan
    step resolved and wrote, plus the tokenized data only tokenize knows; restart policy ExitCode, the plan's image,
    resources, node selector, data PVC and Secrets), submits it through the Training Operator,
    waits for its conditions while streaming the master's logs, and on failure fails with the
    job's last log lines. ``training_backend=trainjob`` does the same with a Kubeflow Trainer v2
    TrainJob on the plan's ``training_runtime`` (docs/trainer-v2.md). ``training_backend=local``
    (kfp.local only) runs the same ``llmft train`` command as a subprocess of this step.

    ``sweep_best``: the HPO pipeline's sweep output (``key=value`` pairs), passed after ``--config``
    so they win over the plan's config.

    With MLflow configured, the trainer's run is a child of the pipeline run's parent run
    (``pipeline-<run_id>``, llmft/components/lib/registry/lineage.py), tagged with the KFP run id.

    The run directory ``<data_root>/runs/<run_id>`` is stable across retries of this task, and
    the trainer resumes from its newest complete checkpoint (``resume=auto``). A cluster failure
    exits with the contract's code (llmft/trainer/errors.py): 200 when the job's pods never start or it
    timed out (retryable), 1 for bad input, never a traceback.

    Progress: the trainer prints a ``progress:`` line (step/total, percent, tokens/s, loss, elapsed, ETA) at
    most every 10 s; this step's log carries the newest one of each poll of the job (llmft/trainer/progress.py).

    Outputs: ``run`` (training_manifest.json and curve.json, the loss curve's end points; metadata ``path`` =
    the run directory), ``metrics`` (final and best eval loss / perplexity, tokens, wall time) and
    ``loss_curve`` (an HTML page: train and eval loss by step, shown in the KFP UI).
    """
    import json
    import os
    import shlex

    from llmft.components.lib.contracts.schema import read_plan
    from llmft.components.lib.jobs.backends import backend_for
    from llmft.components.lib.jobs.loss_curve import render_loss_html
    from llmft.components.lib.jobs.pytorchjob_launch import read_training_manifest, training_metrics
    from llmft.components.lib.registry.lineage import job_env_with_parent, open_for_training, tag_training_run
    from llmft.trainer.io import TRAINING_MANIFEST

    run_plan = read_plan(plan.path)
    run_plan.layout.use_hf_cache()
    trainer, job = run_plan.trainer, run_plan.job
    launch = trainer.launch(tokenized.metadata["path"], shlex.split(sweep_best or ""))
    parent_run = open_for_training(run_plan)  # MLflow: the trainer's run nests under the pipeline run's parent

    backend_for(job.backend).run_train_step(job_env_with_parent(run_plan, parent_run), launch)  # lib/jobs/backends.py

    manifest = read_training_manifest(trainer.run_dir)
    tag_training_run(run_plan, manifest.get("mlflow_run_id"), parent_run)
    os.makedirs(run.path, exist_ok=True)
    with open(os.path.join(run.path, TRAINING_MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True, default=str)
    run.metadata.update(
        {"path": trainer.run_dir, "base_model": trainer.model, "method": trainer.method, "backend": job.backend}
    )
    page, curve = render_loss_html(trainer.run_dir, title=f"Training loss of {os.path.basename(trainer.run_dir)}")
    with open(os.path.join(run.path, "curve.json"), "w") as fh:
        json.dump(curve, fh, indent=2, sort_keys=True)
    with open(loss_curve.path, "w") as fh:
        fh.write(page)
    for name, value in sorted(training_metrics(manifest).items()):
        metrics.log_metric(name, value)
    print(f"training finished: run directory {trainer.run_dir}")
