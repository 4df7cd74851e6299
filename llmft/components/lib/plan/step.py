"""The plan step's body (``plan_run``, llmft/components/plan.py, hands it the typed parameters).

Builds the plan (every check, before any GPU is requested), runs the cluster preflights (Secrets, the
serving namespace, the TrainJob runtime, a writable volume), writes the trainer's resolved config on the
volume and then plan.json: a failed check leaves neither.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from llmft.components.lib.contracts.choices import NO_MLFLOW_REASON
from llmft.components.lib.contracts.schema import RunPlan, write_plan
from llmft.components.lib.jobs.backends import backend_for
from llmft.components.lib.plan.build import build_plan, write_run_config
from llmft.components.lib.plan.checks import check_runs_here, preflight_secrets, preflight_serving_namespace
from llmft.components.lib.plan.parameters import PipelineParameters
from llmft.components.lib.plan.volume_access import check_volume_writable


def run_plan_step(
    parameters: PipelineParameters, plan_dir: str, metadata: MutableMapping[str, Any], *, run_id: str, compiled: str
) -> RunPlan:
    """Check ``parameters``, write ``<data_root>/runs/<run_id>/config.yaml`` and ``plan_dir``/plan.json;
    ``metadata`` (the plan artifact's) gets the schema version, run id, trainer image and job name."""
    run_plan = build_plan(parameters, run_id=run_id, compiled=compiled)
    if run_plan.on_cluster:
        for note in preflight_secrets(run_plan):
            print(f"WARNING: {note}")
        preflight_serving_namespace(run_plan)
        backend_for(run_plan.job.backend).check_preflight(run_plan)  # the registry's: a TrainJob's runtime
        check_volume_writable(run_plan.layout)
    else:
        check_runs_here(run_plan)  # a cluster-only backend: refused here, before prepare and tokenize
        print("kfp.local: Secret preflight skipped (credentials come from this environment)")
    write_run_config(run_plan)  # the trainer's resolved config on the volume, before the plan is handed on
    write_plan(run_plan, plan_dir)
    metadata.update({"schema_version": run_plan.schema_version, "run_id": run_plan.run_id})
    metadata.update({"trainer_image": run_plan.images.trainer, "job": run_plan.job.name})
    print(f"plan: {run_plan.pipeline} run {run_plan.run_id}; trainer image {run_plan.images.trainer}")
    print(f"trainer config: {run_plan.trainer.config_path} (llmft train --config; data= after tokenize)")
    if run_plan.serving.form_note:
        print(f"serving form: merged ({run_plan.serving.form_note})")
    if not run_plan.registry.enabled:
        print(f"mlflow: off, nothing will be tracked or registered: {NO_MLFLOW_REASON}")
    return run_plan
