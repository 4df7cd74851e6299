"""Plans for tests, built by the real builder from the pipelines' own parameter defaults."""

from __future__ import annotations

from llmft.components.lib.contracts.schema import RunPlan
from llmft.components.lib.plan.build import build_plan
from llmft.components.lib.plan.checks import compiled_settings
from llmft.components.lib.plan.parameters import parameter_defaults

RUN_ID = "0f8e6a2c-1d2b-4c3e-9f00-123456789abc"
TRACKING = "http://mlflow.mlflow:5000"


def parameters(**changes) -> dict:
    """Every pipeline parameter (the HPO pipeline's set) at its default, an MLflow URI, then ``changes``."""
    return {**parameter_defaults(), "mlflow_tracking_uri": TRACKING, **changes}


def make_plan(*, hpo: bool = False, environ: dict | None = None, run_id: str = RUN_ID, **changes) -> RunPlan:
    """The plan of a run with ``changes``; ``environ`` {} = kfp.local, {"KFP_POD_NAME": ...} = a cluster task."""
    values = parameters(**changes)
    compiled = compiled_settings("llm-finetune-hpo" if hpo else "llm-finetune", values)
    return build_plan(values, run_id=run_id, compiled=compiled, environ={} if environ is None else environ)


CLUSTER = {"KFP_POD_NAME": "llm-finetune-abcde-system-container-impl-123", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
"""The environment of a KFP task pod (backend/src/v2/compiler/argocompiler/common.go sets KFP_POD_NAME)."""
