"""Helpers of the Katib tests: Experiment builders, and a fake ``CustomObjectsApi`` at the
kubernetes-client boundary that plays Katib's controller.

Where the fake's behaviour comes from: the Experiment status (:func:`katib_status`) has the condition
types and reasons Katib's controller writes (``ExperimentCreated``, ``ExperimentRunning``,
``ExperimentGoalReached``/``ExperimentMaxTrialsReached``/``ExperimentFailed`` with ``Experiment is running``
etc.: kubeflow/katib ``pkg/controller.v1beta1/experiment/util/status_util.go``, as stored, the constants and
``UpdateExperimentStatusCondition``) and ``currentOptimalTrial`` with ``bestTrialName``,
``parameterAssignments`` and ``observation.metrics`` min/max/latest as strings (``updateTrialsSummary`` in
the same file). 409 on a second create and 404 on a missing object as the API server answers
(tests/k8s/k8s_fakes.py cites the source).

Not traced to source (test choices): the controller is a script (``statuses``, the n-th GET answers the
n-th status) rather than trials that run; the ``Created`` condition's message, the timestamps (relative to
the test's clock) and the sample numbers in :data:`BEST` are made up; the tests' own Experiment names.
"""

from __future__ import annotations

import copy
import json

from fake_clock import rfc3339_now
from kubernetes.client.rest import ApiException

from llmft.katib.experiment import experiment_dict

JOB = {"base_model": "Qwen/Qwen2.5-7B-Instruct", "data": "/data/tokenized/CACHE_KEY", "volume_pvc_name": "llmft-data"}


def build_body(*overrides: str, **job) -> dict:
    """An Experiment dict built by the real composition (katib + the plan's job + lib.jobs.pytorchjob_spec),
    the way `llmft sweep create` builds it."""
    from llmft.commands.sweep import build_from_settings

    settings = [*overrides, *(f"{k}={v}" for k, v in {**JOB, **job}.items())]
    return experiment_dict(build_from_settings(settings))


def trial_words(container: dict) -> list[str]:
    """The words of a trial container's command line: its ``sh -c`` script (llmft/components/lib/jobs/pytorchjob_spec.py
    katib_trial_script) split on whitespace, or its plain command and args."""
    return " ".join([*container.get("command", []), *container.get("args", [])]).split()


def sweep_plan(*, run_id: str = "run-0001", environ: dict | None = None, **changes):
    """The HPO pipeline's plan with ``changes`` over its parameter defaults (the real plan builder)."""
    from llmft.components.lib.plan.build import build_plan
    from llmft.components.lib.plan.checks import compiled_settings
    from llmft.components.lib.plan.parameters import parameter_defaults

    values = {**parameter_defaults(), **changes}
    environ = {"MLFLOW_TRACKING_URI": "unused-by-the-plan"} if environ is None else environ
    compiled = compiled_settings("llm-finetune-hpo", values)
    return build_plan(values, run_id=run_id, compiled=compiled, environ=environ)


def api_error(status: int, message: str) -> ApiException:
    exc = ApiException(status=status, reason="Conflict" if status == 409 else "NotFound")
    exc.body = json.dumps({"kind": "Status", "message": message, "code": status})
    return exc


class FakeKatibApi:
    """In-memory ``CustomObjectsApi``. ``statuses`` is the script of Katib's controller: the
    n-th GET of an Experiment returns ``statuses[min(n, len-1)]`` as its status."""

    def __init__(self, statuses: list[dict] | None = None):
        self.objects: dict[tuple, dict] = {}
        self.created: list[tuple[str, dict]] = []
        self.statuses = statuses or [{}]
        self.gets = 0

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **_):
        key = (group, version, namespace, plural, body["metadata"]["name"])
        if key in self.objects:
            raise api_error(409, f'{plural}.{group} "{key[-1]}" already exists')
        stored = json.loads(json.dumps(body))
        stored["metadata"]["namespace"] = namespace
        self.objects[key] = stored
        self.created.append((namespace, stored))
        return copy.deepcopy(stored)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_):
        key = (group, version, namespace, plural, name)
        if key not in self.objects:
            raise api_error(404, f'{plural}.{group} "{name}" not found')
        obj = self.objects[key]
        obj["status"] = copy.deepcopy(self.statuses[min(self.gets, len(self.statuses) - 1)])
        self.gets += 1
        return copy.deepcopy(obj)


def katib_status(
    phase: str, *, best: dict | None = None, reason: str = "", message: str = "", trials: dict | None = None
) -> dict:
    """An Experiment status as Katib 0.19 writes it."""
    conditions = [
        {
            "type": "Created",
            "status": "True",
            "reason": "ExperimentCreated",
            "message": "Experiment is created",
            "lastUpdateTime": rfc3339_now(-3600),
        }
    ]
    if phase != "Created":
        conditions.append(
            {
                "type": "Running",
                "status": "False" if phase in ("Succeeded", "Failed") else "True",
                "reason": "ExperimentRunning",
                "message": "Experiment is running",
                "lastUpdateTime": rfc3339_now(-3540),
            }
        )
    if phase in ("Succeeded", "Failed"):
        conditions.append(
            {
                "type": phase,
                "status": "True",
                "reason": reason,
                "message": message,
                "lastUpdateTime": rfc3339_now(),
            }
        )
    status = {"conditions": conditions, "startTime": rfc3339_now(-3600), **(trials or {})}
    if best:
        status["currentOptimalTrial"] = {
            "bestTrialName": best["trial"],
            "parameterAssignments": [{"name": k, "value": v} for k, v in best["params"].items()],
            "observation": {
                "metrics": [
                    {"name": k, "min": str(v), "max": str(v + 1), "latest": str(v + 0.5)}
                    for k, v in best["metrics"].items()
                ]
            },
        }
    return status


BEST = {
    "trial": "llmft-sweep-x7k2p9qd",
    "params": {
        "learning_rate": "0.00031",
        "lora_r": "32",
        "lora_alpha": "64",
        "lora_dropout": "0.02",
        "warmup_ratio": "0.05",
    },
    "metrics": {"eval_loss": 1.25, "perplexity": 3.49},
}
