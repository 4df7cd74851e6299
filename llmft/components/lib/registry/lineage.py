"""One lineage tree in MLflow per pipeline run: a parent run tagged with the KFP run id, and the train,
evaluate and register work as its children.

* :func:`pipeline_parent_run` finds or creates the parent, ``pipeline-<KFP run id>``, tagged
  ``llmft.pipeline_run_id`` (the KFP run id, the same for every retry) and ``llmft.step=pipeline``;
  every step looks it up by those tags, so retries and later steps land in the same tree.
* The train step opens it before the job starts and hands its id to the trainer
  (``LLMFT_MLFLOW_PARENT_RUN_ID``: the trainer starts its run with ``parent_run_id``); after training
  :func:`tag_training_run` tags the trainer's run with the KFP run id and ``llmft.step=train``.
* The evaluate step logs a child ``evaluate-<id>`` (:func:`record_evaluation`): base and every
  checkpoint's eval loss and perplexity, the task scores, evaluation.json and the HTML report.
* The register step logs its child ``register-<id>`` (llmft/components/lib/registry/mlflow_registry.py)
  and registers the model version from the training run (llmft/components/lib/registry/mlflow_model.py).

MLflow nests a run under another by the tag ``mlflow.parentRunId`` (``mlflow/utils/mlflow_tags.py``
``MLFLOW_PARENT_RUN_ID``; ``mlflow.start_run(parent_run_id=...)`` sets it too). Nothing here is
required for a step to succeed: MLflow is optional (an empty ``mlflow_tracking_uri`` and no mlflow
Secret: the plan's ``registry.enabled`` is false and every function here does nothing), and a
tracking server that fails here costs the lineage, never the run (one warning line).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from llmft.components.lib.contracts.metrics import task_scores
from llmft.trainer.mlflow_settings import PARENT_RUN_ENV, prepare_mlflow, tracking_uri_without_credentials

PIPELINE_RUN_TAG = "llmft.pipeline_run_id"
"""The KFP run id (the Lineage tag of the model version carries the same name and value)."""
STEP_TAG = "llmft.step"
PARENT_TAG = "mlflow.parentRunId"
PIPELINE_STEP = "pipeline"


def tracking_client(plan):
    """An MlflowClient for the plan's tracking server, or None when the run has no MLflow (or it does not
    answer: the reason is printed)."""
    if not plan.registry.enabled:
        return None
    uri = tracking_uri_without_credentials(plan.registry.tracking_uri or None)
    if not uri:
        return None
    if reason := prepare_mlflow(uri, required=False):
        print(f"warning: {reason}; the MLflow lineage of this run is incomplete")
        return None
    from mlflow import MlflowClient  # heavy: mlflow

    return MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str) -> str:
    """The experiment's id, created when missing (one created concurrently by a parallel step is reused)."""
    from mlflow.exceptions import MlflowException  # heavy: mlflow

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException as exc:
        if str(getattr(exc, "error_code", "")) != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def _find_run(client, experiment: str, tags: Mapping[str, str]):
    clauses = " and ".join(f"tags.`{k}` = '{_quote(v)}'" for k, v in tags.items())
    found = client.search_runs([experiment], filter_string=clauses, max_results=1)
    return found[0] if found else None


def pipeline_parent_run(client, experiment: str, pipeline_run_id: str, pipeline: str = "llm-finetune") -> str:
    """The id of the pipeline run's parent MLflow run (found by its tags, else created)."""
    tags = {PIPELINE_RUN_TAG: pipeline_run_id, STEP_TAG: PIPELINE_STEP}
    run = _find_run(client, experiment, tags)
    if run is None:
        run = client.create_run(
            experiment, run_name=f"pipeline-{pipeline_run_id}"[:250], tags={**tags, "llmft.pipeline": pipeline}
        )
    return run.info.run_id


def child_run(client, experiment: str, parent_id: str, pipeline_run_id: str, step: str, tags: Mapping[str, str] = {}):
    """The pipeline run's child run of ``step`` (found by its tags, else created under ``parent_id``)."""
    keys = {PIPELINE_RUN_TAG: pipeline_run_id, STEP_TAG: step}
    run = _find_run(client, experiment, keys)
    if run is None:
        run = client.create_run(
            experiment, run_name=f"{step}-{pipeline_run_id}"[:250], tags={**keys, PARENT_TAG: parent_id, **tags}
        )
    return run


def guarded(what: str, fn: Callable[[], Any]) -> Any:
    """Run one lineage action; a failure is one warning line and None (the step goes on)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - MLflow lineage never fails a step
        print(f"warning: MLflow lineage: {what} failed ({type(exc).__name__}: {_first_line(exc)}); the step goes on")
        return None


def open_for_training(plan) -> str | None:
    """The train step, before the job: the parent run's id, exported as ``LLMFT_MLFLOW_PARENT_RUN_ID`` (a local
    trainer inherits it; the job's env carries it: :func:`job_env_with_parent`), or None without MLflow."""
    client = tracking_client(plan)
    if client is None:
        return None

    def parent() -> str:
        return pipeline_parent_run(client, experiment_id(client, plan.registry.experiment), plan.run_id, plan.pipeline)

    parent_id = guarded("opening the pipeline's parent run", parent)
    if parent_id:
        os.environ[PARENT_RUN_ENV] = parent_id
        print(f"mlflow: the training run nests under pipeline-{plan.run_id} ({parent_id})")
    return parent_id


def sweep_parent_tags(plan) -> dict[str, str]:
    """Tags that make a sweep's parent run (llmft/katib/tracking.py ``ParentRun``) a child of the pipeline run's, its
    trials' runs grandchildren: one tree for the HPO pipeline too ({} without MLflow)."""
    parent_id = open_for_training(plan)
    if not parent_id:
        return {}
    return {PARENT_TAG: parent_id, PIPELINE_RUN_TAG: plan.run_id, STEP_TAG: "sweep"}


def job_env_with_parent(plan, parent_id: str | None):
    """``plan`` whose job env also carries the parent run's id (what the cluster job's trainer reads)."""
    if not parent_id:
        return plan
    job = dataclasses.replace(plan.job, env={**plan.job.env, PARENT_RUN_ENV: parent_id})
    return dataclasses.replace(plan, job=job)


def tag_training_run(plan, training_run_id: str | None, parent_id: str | None) -> None:
    """After training: the trainer's run carries the KFP run id and ``llmft.step=train``."""
    client = tracking_client(plan) if training_run_id and parent_id else None
    if client is None:
        return

    def tag() -> None:
        for key, value in {PIPELINE_RUN_TAG: plan.run_id, STEP_TAG: "train"}.items():
            client.set_tag(training_run_id, key, value)
        client.set_terminated(parent_id, "FINISHED")  # the parent's end time follows its last child

    guarded("tagging the training run", tag)


def evaluation_metrics(evaluation: dict[str, Any]) -> list[tuple[str, float, int]]:
    """(name, value, step) of an evaluation.json: the base's (step 0) and every checkpoint's (its step) eval loss,
    perplexity and task scores, and the best checkpoint's as ``best_<name>``; finite values only."""

    def numbers(model: dict) -> dict[str, float]:
        found = {"eval_loss": model.get("eval_loss"), "perplexity": model.get("perplexity"), **task_scores(model)}
        return {k: float(v) for k, v in found.items() if isinstance(v, int | float) and math.isfinite(v)}

    rows = [(f"base_{k}", v, 0) for k, v in numbers(evaluation["base"]).items()]
    for checkpoint in evaluation.get("checkpoints") or []:
        rows += [(k, v, int(checkpoint.get("step") or 0)) for k, v in numbers(checkpoint).items()]
        if checkpoint.get("name") == evaluation.get("best"):
            rows += [(f"best_{k}", v, 0) for k, v in numbers(checkpoint).items()]
    return rows


def record_evaluation(plan, evaluation: dict[str, Any], files: tuple[str | Path, ...] = ()) -> str | None:
    """The evaluate step's child run: :func:`evaluation_metrics`, and ``files`` as artifacts. Returns its id."""
    client = tracking_client(plan)
    if client is None:
        return None

    def record() -> str:
        from mlflow.entities import Metric  # heavy: mlflow

        experiment = experiment_id(client, plan.registry.experiment)
        parent = pipeline_parent_run(client, experiment, plan.run_id, plan.pipeline)
        run_id = child_run(client, experiment, parent, plan.run_id, "evaluate").info.run_id
        metrics = [Metric(name, value, 0, step) for name, value, step in evaluation_metrics(evaluation)]
        for start in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics per call
            client.log_batch(run_id, metrics=metrics[start : start + 1000])
        for path in files:
            if Path(path).is_file():
                client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, "FINISHED")
        client.set_terminated(parent, "FINISHED")
        return run_id

    run_id = guarded("recording the evaluation", record)
    if run_id:
        print(f"mlflow: evaluation logged to run evaluate-{plan.run_id} ({run_id})")
    return run_id


def _quote(text: str) -> str:
    return str(text).replace("'", "\\'")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
