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

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import yaml

from llmft.katib.errors import SweepError


class JobResource(NamedTuple):
    """A custom resource's (group, version, plural, kind): what the API server's paths, RBAC rules and a body's
    ``apiVersion``/``kind`` name. Each training backend's is written once, here or in its own module, and read
    from the registry (llmft/components/lib/jobs/backends.py)."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


PYTORCHJOB_RESOURCE = JobResource("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
TRAINJOB_RESOURCE = JobResource("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob")
EXPERIMENT_RESOURCE = JobResource("kubeflow.org", "v1beta1", "experiments", "Experiment")
"""Katib's Experiment (llmft/katib/experiment.py builds it); here so the run's cleanup names it without
importing the Experiment builder's heavy dependencies."""


@dataclass(frozen=True)
class TrialKind:
    """What Katib needs to know of one kind of trial job."""

    resource: JobResource
    primary_container_name: str
    primary_pod_labels: Mapping[str, str]
    success_condition: str
    failure_condition: str
    container_rule: str
    """Where the trainer's command lives in the job, for error messages."""
    find_command: Callable[[Mapping[str, Any]], dict[str, Any] | None]
    """The dict holding the trainer's ``command``/``args`` in a job of this kind (None when missing)."""

    @property
    def api_version(self) -> str:
        return self.resource.api_version

    @property
    def kind(self) -> str:
        return self.resource.kind

    def command_holder(self, job: Mapping[str, Any]) -> dict[str, Any] | None:
        """The dict holding the trainer's ``command``/``args`` in ``job`` (None when missing)."""
        try:
            return self.find_command(job)
        except (KeyError, TypeError):
            return None


def _pytorchjob_command(job: Mapping[str, Any]) -> dict[str, Any] | None:
    containers = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    return next((c for c in containers if c.get("name") == PYTORCHJOB.primary_container_name), None)


def _trainjob_command(job: Mapping[str, Any]) -> dict[str, Any] | None:
    trainer = job["spec"]["trainer"]
    return trainer if trainer.get("command") or trainer.get("args") else None


PYTORCHJOB = TrialKind(
    resource=PYTORCHJOB_RESOURCE,
    primary_container_name="pytorch",
    primary_pod_labels={"training.kubeflow.org/job-role": "master"},
    success_condition='status.conditions.#(type=="Succeeded")#|#(status=="True")#',
    failure_condition='status.conditions.#(type=="Failed")#|#(status=="True")#',
    container_rule="spec.pytorchReplicaSpecs.Master must have a container named 'pytorch' "
    "(Katib's primaryContainerName and the operator's rule)",
    find_command=_pytorchjob_command,
)
TRAINJOB = TrialKind(
    resource=TRAINJOB_RESOURCE,
    primary_container_name="node",
    primary_pod_labels={
        "jobset.sigs.k8s.io/replicatedjob-name": "node",
        "batch.kubernetes.io/job-completion-index": "0",
    },
    success_condition='status.conditions.#(type=="Complete")#|#(status=="True")#',
    failure_condition='status.conditions.#(type=="Failed")#|#(status=="True")#',
    container_rule="spec.trainer must set the command (the runtime's `node` container runs it)",
    find_command=_trainjob_command,
)
# keyed by (apiVersion, kind); looked up with a job dict's values, which may be missing. The training backends'
# registry (llmft/components/lib/jobs/backends.py) adds the trial kinds of the backends it registers: katib/ is
# a leaf and never imports it, so the kinds come down as data.
TRIAL_KINDS: dict[tuple[str | None, str | None], TrialKind] = {
    (k.api_version, k.kind): k for k in (PYTORCHJOB, TRAINJOB)
}


def register_trial_kind(kind: TrialKind) -> None:
    """Let Katib sweeps run trials of ``kind`` (a training backend's, handed down by the registry)."""
    TRIAL_KINDS[(kind.api_version, kind.kind)] = kind


def unregister_trial_kind(kind: TrialKind) -> None:
    TRIAL_KINDS.pop((kind.api_version, kind.kind), None)


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
        "or sweep with training_backend=pytorchjob (PyTorchJob trials)"
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
