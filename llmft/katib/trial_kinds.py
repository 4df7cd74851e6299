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

llmft/katib/ stays a leaf: the jobs themselves are built in llmft/components/ and handed over as dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

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


KATIB_CONFIG_MAP = "katib-config"
"""Katib's ConfigMap (kubeflow/katib v0.19.0 pkg/controller.v1beta1/consts/const.go 108-111), in the
namespace Katib is installed in (``kubeflow`` in its manifests), key ``katib-config.yaml``."""
KATIB_CONFIG_KEY = "katib-config.yaml"
KATIB_NAMESPACE = "kubeflow"


def trial_resource(kind: TrialKind) -> str:
    """How katib-config's ``init.controller.trialResources`` names ``kind``: Kind.version.group."""
    group, _, version = kind.api_version.rpartition("/")
    return f"{kind.kind}.{version}.{group}"


def trial_resource_problem(config_text: str, kind: TrialKind) -> str | None:
    """Why Katib would never see ``kind`` trials end, from katib-config.yaml's text; None when listed.

    The trial controller watches only the kinds listed in ``trialResources`` (trial_controller.go
    103-131 at v0.19.0): a trial of another kind is created, runs, and its end is never read. Several
    configs shipped at v0.19.0 list no TrainJob (installs/katib-external-db, katib-leader-election,
    katib-openshift, katib-standalone-postgres; katib-standalone and katib-cert-manager do)."""
    config = yaml.safe_load(config_text) or {}
    listed = ((config.get("init") or {}).get("controller") or {}).get("trialResources") or []
    wanted = trial_resource(kind)
    if wanted in listed:
        return None
    return (
        f"Katib's ConfigMap {KATIB_CONFIG_MAP} ({KATIB_CONFIG_KEY}, init.controller.trialResources) does not list "
        f"{wanted}: Katib would create {kind.kind} trials and never see them end. Add {wanted} to trialResources "
        f"and restart katib-controller (kubectl -n {KATIB_NAMESPACE} rollout restart deploy/katib-controller), "
        "or sweep with training_backend=kubeflow (PyTorchJob trials)"
    )


def check_trial_resources(cluster: Any, kind: TrialKind, *, print_fn=print) -> None:
    """Preflight of a sweep's trials: SweepError (one line) when Katib's readable config does not list
    ``kind``; a note when the ConfigMap cannot be read (RBAC), as that is then a prerequisite the run
    cannot check (docs/katib.md). ``cluster.read_config_map(name, namespace)`` returns its data."""
    if kind.kind == "PyTorchJob":
        return  # every katib-config shipped at v0.19.0 lists PyTorchJob.v1.kubeflow.org
    try:
        data = cluster.read_config_map(KATIB_CONFIG_MAP, KATIB_NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - ClusterError (403/404), duck-typed: llmft/katib/ stays a leaf
        print_fn(
            f"note: cannot read {KATIB_NAMESPACE}/{KATIB_CONFIG_MAP} ({exc}); make sure its trialResources list "
            f"{trial_resource(kind)}, or the {kind.kind} trials' end is never seen"
        )
        return
    text = (data or {}).get(KATIB_CONFIG_KEY)
    if text is None:
        print_fn(f"note: {KATIB_NAMESPACE}/{KATIB_CONFIG_MAP} has no {KATIB_CONFIG_KEY}: its trialResources unchecked")
        return
    problem = trial_resource_problem(text, kind)
    if problem:
        raise SweepError(problem)
