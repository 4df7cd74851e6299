"""The sweep's MLflow parent run; each trial's trainer logs its own run as a child.

Used only when ``MLFLOW_TRACKING_URI`` is set (mlflow is imported lazily). Everything goes
through an explicit ``MlflowClient`` bound to that URI, so nothing here changes MLflow's
process-wide state (tracking URI, active run) for the caller.

A trial learns its parent from the environment :meth:`ParentRun.env` returns:
``LLMFT_MLFLOW_PARENT_RUN_ID`` (the trainer passes it to ``mlflow.start_run(parent_run_id=...)``)
and ``MLFLOW_EXPERIMENT_NAME`` (children must live in the parent's experiment).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from llmft.trainer.mlflow_settings import PARENT_RUN_ENV, tracking_uri_without_credentials

if TYPE_CHECKING:
    from mlflow import MlflowClient

DEFAULT_EXPERIMENT = "llmft"
"""The trainer's default MLflow experiment (observe.mlflow_experiment, else MLFLOW_EXPERIMENT_NAME, else this)."""


class ParentRun:
    """Context manager around the parent run; every method is a no-op when MLflow is not configured."""

    def __init__(
        self,
        run_name: str,
        experiment: str = "",
        *,
        params: dict[str, Any] | None = None,
        tags: dict[str, str] | None = None,
    ):
        self.run_name, self.params, self.tags = run_name, params or {}, tags or {}
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        self.client: MlflowClient | None = None
        self.run_id: str | None = None

    def __enter__(self) -> ParentRun:
        uri = tracking_uri_without_credentials()  # trials inherit the URI without a password in it
        if not uri:
            return self
        # heavy: mlflow
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags={"llmft.kind": "sweep", **self.tags})
        self.run_id = run.info.run_id
        self.log_params(self.params)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FAILED" if exc_type else "FINISHED")

    def env(self) -> dict[str, str]:
        """Environment of a trial's trainer: its run becomes a child of this one."""
        if self.run_id is None:
            return {}
        return {PARENT_RUN_ENV: self.run_id, "MLFLOW_EXPERIMENT_NAME": self.experiment}

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.log_metric(self.run_id, key, float(value), step=step or 0)

    def log_params(self, params: dict[str, Any]) -> None:
        if self.client is not None and self.run_id is not None:
            for key, value in params.items():
                self.client.log_param(self.run_id, key, value)

    def log_artifact(self, path: str) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.log_artifact(self.run_id, path)
