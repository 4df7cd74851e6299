"""The job kinds a Katib trial of this project runs, and what Katib 0.19 needs to know of each.

Katib reads a trial's end from ``successCondition`` / ``failureCondition`` (GJSON paths on the
job's status) and collects metrics from the ``primaryContainerName`` of the pods matching
``primaryPodLabels``. Its defaults per kind (kubeflow/katib v0.19.0
``pkg/apis/controller/experiments/v1beta1/constants.go`` 32-50, applied by
``experiment_defaults.go`` 97-137) are written out explicitly here:

- PyTorchJob (Training Operator v1): conditions ``Succeeded`` / ``Failed``, container ``pytorch``,
  pods labelled ``training.kubeflow.org/job-role: master``.
- TrainJob (Kubeflow Trainer v2, listed in katib-config's ``trialResources``,
  ``manifests/v1beta1/installs/katib-standalone/katib-config.yaml`` 8-9): conditions
  ``Complete`` / ``Failed`` (the TrainJob's own, trainer ``trainjob_types.go`` 56-65), container
  ``node``, pods of replicated job ``node`` with completion index 0 (node 0, where rank 0 prints
  the metrics). Katib's pod webhook finds the Trial through the owner chain pod -> Job -> JobSet
  -> TrainJob -> Trial (``pkg/webhook/v1beta1/pod/inject_webhook.go`` 255-300); its controller
  role may get jobsets and create/delete trainjobs (``manifests/v1beta1/components/controller/rbac.yaml`` 93-110).

katib/ stays a leaf: the jobs themselves are built in components/ and handed over as dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmft.katib.errors import SweepError


@dataclass(frozen=True)
class TrialKind:
    """What Katib needs to know of one kind of trial job."""

    api_version: str
    kind: str
    primary_container_name: str
    primary_pod_labels: Mapping[str, str]
    success_condition: str
    failure_condition: str
    container_rule: str
    """Where the trainer's command lives in the job, for error messages."""

    def command_holder(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        """The dict holding the trainer's ``command``/``args`` in ``job`` (None when missing)."""
        try:
            if self.kind == "PyTorchJob":
                containers = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
                return next((c for c in containers if c.get("name") == self.primary_container_name), None)
            trainer = job["spec"]["trainer"]
            return trainer if trainer.get("command") or trainer.get("args") else None
        except (KeyError, TypeError):
            return None


PYTORCHJOB = TrialKind(
    api_version="kubeflow.org/v1",
    kind="PyTorchJob",
    primary_container_name="pytorch",
    primary_pod_labels={"training.kubeflow.org/job-role": "master"},
    success_condition='status.conditions.#(type=="Succeeded")#|#(status=="True")#',
    failure_condition='status.conditions.#(type=="Failed")#|#(status=="True")#',
    container_rule="spec.pytorchReplicaSpecs.Master must have a container named 'pytorch' "
    "(Katib's primaryContainerName and the operator's rule)",
)
TRAINJOB = TrialKind(
    api_version="trainer.kubeflow.org/v1alpha1",
    kind="TrainJob",
    primary_container_name="node",
    primary_pod_labels={
        "jobset.sigs.k8s.io/replicatedjob-name": "node",
        "batch.kubernetes.io/job-completion-index": "0",
    },
    success_condition='status.conditions.#(type=="Complete")#|#(status=="True")#',
    failure_condition='status.conditions.#(type=="Failed")#|#(status=="True")#',
    container_rule="spec.trainer must set the command (the runtime's `node` container runs it)",
)
# keyed by (apiVersion, kind); looked up with a job dict's values, which may be missing
TRIAL_KINDS: dict[tuple[str | None, str | None], TrialKind] = {
    (k.api_version, k.kind): k for k in (PYTORCHJOB, TRAINJOB)
}


def trial_kind(job: Mapping[str, Any]) -> TrialKind:
    """The :class:`TrialKind` of a trial job dict; SweepError for any other kind."""
    found = TRIAL_KINDS.get((job.get("apiVersion"), job.get("kind")))
    if found is None:
        known = ", ".join(f"{a} {k}" for a, k in TRIAL_KINDS)
        raise SweepError(f"trial job: expected one of {known}, got {job.get('apiVersion')!r} {job.get('kind')!r}")
    return found
