"""Build and validate the trainer's TrainJob (Kubeflow Trainer v2, trainer.kubeflow.org/v1alpha1).

``build_trainjob(JobSpec, runtime)`` returns the Kubeflow SDK's own model
(``kubeflow_trainer_api.models.TrainerV1alpha1TrainJob``) of a TrainJob that references a
(Cluster)TrainingRuntime (default ``torch-distributed``, the one a default install ships) and
overrides what the trainer needs through the v2.3 API:

- ``spec.trainer``: image, ``command``/``args`` = ``llmft train --nproc N ...`` (exactly the
  PyTorchJob's, from the same :func:`~llmft.components.lib.jobs.pytorchjob_spec.pod_template`), ``env``
  (plain values and the Secret references), ``numNodes``, ``numProcPerNode`` and
  ``resourcesPerNode``;
- ``spec.runtimePatches[manager=PATCH_MANAGER]``: the ``node`` pods' volumes (the data PVC and the
  in-memory /dev/shm), the ``node`` container's volume mounts, node selector, tolerations, pod
  security context, service account, pull secrets, and the pod labels (the run-id label) and
  annotations;
- ``spec.activeDeadlineSeconds``: the job's wall-clock limit.

Why those fields (kubeflow/trainer v2.3.0): ``pkg/runtime/framework/plugins/jobset/builder.go``
113-155 copies ``trainer.image/command/args/env`` into the container named ``node`` of the
replicated job labelled ``trainer.kubeflow.org/trainjob-ancestor-step: trainer``;
``pkg/runtime/core/trainingruntime.go`` 251-290 strategic-merges each runtime patch onto the
runtime's JobSet spec and 199-236 merges ``resourcesPerNode`` into the ``node`` container;
``pkg/runtime/framework/plugins/jobset/jobset.go`` 199-206 refuses env in a patch of the ``node``
container (so every variable goes through ``trainer.env``); ``pkg/runtime/framework/plugins/torch/
torch.go`` 65-77 refuses the PET_* names in ``trainer.env`` and 110-204 injects PET_NNODES,
PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT, which torchrun (under ``llmft train``)
reads: the same command serves PyTorchJob and TrainJob.

``trial_trainjob_dict`` gives the same job as a plain dict without metadata.name/namespace, the
Katib trial template (llmft/katib/ takes the dict). Running it: llmft/components/lib/jobs/trainjob_launch.py.
"""

from __future__ import annotations

import re
from typing import Any

from llmft.components.lib.contracts.schema import DEFAULT_RUNTIME
from llmft.components.lib.jobs.katib_trial import katib_trial_script, shell_safe
from llmft.components.lib.jobs.pytorchjob_spec import _spec_errors, pod_template, resolved_nproc
from llmft.katib.k8s_names import RFC1035_LABEL, RFC1123_SUBDOMAIN
from llmft.katib.trial_kinds import TRAINJOB_RESOURCE
from llmft.trainer.command_line import format_overrides
from llmft.trainer.errors import ConfigError

GROUP, VERSION, PLURAL, KIND = RESOURCE = TRAINJOB_RESOURCE  # written once: llmft/katib/trial_kinds.py
API_VERSION = f"{GROUP}/{VERSION}"
RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
TRAINER_JOB = TRAINER_CONTAINER = "node"
"""Replicated job and container of the trainer nodes (pkg/constants/constants.go 68-69, ``Node``)."""
PATCH_MANAGER = "kfp-llm-finetune/launcher"
"""``runtimePatches[].manager`` of this project's patch (a domain-prefixed path, jobset.go 176)."""
RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
"""torchrun variables the torch plugin sets itself (constants.go 300 ``TorchRunReservedEnvNames``)."""
POD_SUFFIX = "-abcde"
"""JobSet validates the longest pod name with a 5-character random suffix (jobset v0.12.0
pkg/webhooks/jobset_webhook.go 243-255): ``<trainjob>-node-0-<nodes-1>-xxxxx`` <= 63."""
_HTTP_PATH = re.compile(r"^[A-Za-z0-9/\-._~%!$&'()*+,;=:]+$")


def parse_runtime_ref(value: str) -> tuple[str, str]:
    """``NAME`` (a ClusterTrainingRuntime, the API default) or ``TrainingRuntime/NAME`` (in the job's
    namespace) or ``ClusterTrainingRuntime/NAME`` -> (kind, name); ConfigError naming the fix."""
    kind, sep, name = (value or "").partition("/")
    if not sep:
        kind, name = RUNTIME_KINDS[0], kind
    if kind not in RUNTIME_KINDS or not RFC1123_SUBDOMAIN.match(name) or len(name) > 253:
        raise ConfigError(
            f"training runtime {value!r}: expected NAME (a ClusterTrainingRuntime, e.g. {DEFAULT_RUNTIME}) or "
            "TrainingRuntime/NAME (one in the job's namespace); names are lowercase DNS subdomains"
        )
    return kind, name


def trainjob_spec_errors(spec) -> list[str]:
    """The PyTorchJob builder's checks of a ``JobSpec`` plus what differs for a TrainJob."""

    errors = [e for e in _spec_errors(spec) if not e.startswith("name ")]
    longest_pod = f"{spec.name}-{TRAINER_JOB}-0-{max(spec.num_nodes - 1, 0)}{POD_SUFFIX}"
    if not RFC1035_LABEL.match(spec.name) or len(longest_pod) > 63:
        errors.append(
            f"name {spec.name!r}: must be a DNS-1035 label short enough that JobSet's pod name "
            f"{longest_pod!r} fits 63 characters"
        )
    if spec.elastic is not None:
        errors.append("elastic: Kubeflow Trainer v2.3 runs a fixed number of nodes (torch.go 109: no elastic yet)")
    reserved = sorted(set(RESERVED_ENV) & ({s.env_name for s in spec.secret_envs} | set(spec.env)))
    if reserved:
        errors.append(f"env: {reserved} are set by the Trainer's torch plugin and may not be set")
    return errors


def _k8s(obj) -> Any:
    """A kubernetes-client model as the API server sees it (camelCase, no None)."""
    from kubernetes import client  # heavy: kubernetes

    return client.ApiClient().sanitize_for_serialization(obj)


def trainjob_body(spec, runtime: str = DEFAULT_RUNTIME) -> dict:
    """The TrainJob for ``spec`` as a plain dict (the PyTorchJob replica's pod, mapped onto TrainJob fields)."""

    kind, name = parse_runtime_ref(runtime)
    template = _k8s(pod_template(spec))
    pod = template["spec"]
    container = pod.pop("containers")[0]
    trainer: dict[str, Any] = {
        "image": container["image"],
        "command": container["command"],
        "args": container["args"],
        "numNodes": spec.num_nodes,
    }
    nproc = resolved_nproc(spec)
    if nproc.isdigit():  # auto / gpu / cpu: the torch plugin's own default ("auto", torch.go 121-135)
        trainer["numProcPerNode"] = int(nproc)
    for field_name in ("env", "resources"):
        if container.get(field_name):
            trainer["resourcesPerNode" if field_name == "resources" else "env"] = container[field_name]
    pod["containers"] = [{"name": TRAINER_CONTAINER, "volumeMounts": container["volumeMounts"]}]
    replicated_job = {
        "name": TRAINER_JOB,
        "template": {"spec": {"template": {"metadata": template["metadata"], "spec": pod}}},
    }
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [replicated_job]}}},
    }
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": spec.name, "labels": {"app.kubernetes.io/part-of": "kfp-llm-finetune", **spec.labels}},
        "spec": {
            "runtimeRef": {"apiGroup": GROUP, "kind": kind, "name": name},
            "trainer": trainer,
            "runtimePatches": [patch],
        },
    }
    if spec.namespace:
        body["metadata"]["namespace"] = spec.namespace
    if spec.active_deadline_seconds:
        body["spec"]["activeDeadlineSeconds"] = spec.active_deadline_seconds
    return body


def build_trainjob(spec, runtime: str = DEFAULT_RUNTIME):
    """The TrainJob for ``spec`` as the SDK's model (``TrainerV1alpha1TrainJob``); raises ConfigError,
    listing every problem, before anything reaches the cluster."""
    errors = trainjob_spec_errors(spec)
    if errors:
        raise ConfigError(f"TrainJob {spec.name!r}: " + "; ".join(errors))
    body = trainjob_body(spec, runtime)
    problems = trainjob_admission_errors(body)
    if problems:  # a bug in this builder, not in the spec
        raise ConfigError(f"TrainJob {spec.name!r} would be rejected by the Trainer: " + "; ".join(problems))
    return parse_trainjob(body)


def parse_trainjob(body: dict):
    """``body`` as the SDK's model; refuses a field the model does not know (pydantic drops them silently)."""
    from kubeflow_trainer_api import models  # heavy: kubeflow_trainer_api

    model = models.TrainerV1alpha1TrainJob.from_dict(body)
    dropped = _dropped_paths(body, model.to_dict(), "")
    if dropped:
        raise ConfigError("TrainJob has fields the v1alpha1 API does not define: " + ", ".join(dropped))
    return model


def _dropped_paths(original: Any, dumped: Any, path: str) -> list[str]:
    if isinstance(original, dict):
        dumped = dumped if isinstance(dumped, dict) else {}
        return [
            p
            for key, value in original.items()
            if value is not None
            for p in ([f"{path}.{key}".lstrip(".")] if key not in dumped else _dropped_paths(value, dumped[key], key))
        ]
    if isinstance(original, list) and isinstance(dumped, list):
        return [p for o, d in zip(original, dumped, strict=False) for p in _dropped_paths(o, d, path)]
    return []


def trainjob_to_dict(job) -> dict:
    """The job as the API server receives it (camelCase keys, no None values): what the SDK sends."""
    return job.to_dict()


def trainjob_admission_errors(job: dict) -> list[str]:
    """What the TrainJob CRD's CEL rules and the Trainer's validating webhook check beyond the schema
    (v2.3.0 ``trainjob_types.go`` 36-37, ``jobset.go`` 175-209, ``torch.go`` 65-77). ``metadata.name``
    is checked only when present (a Katib trial template has none)."""
    errors = []
    name = (job.get("metadata") or {}).get("name")
    if name is not None and not (RFC1035_LABEL.match(name) and len(name) <= 63):
        errors.append(f"metadata.name {name!r}: must be an RFC 1035 label of at most 63 characters")
    spec = job.get("spec") or {}
    if not (spec.get("runtimeRef") or {}).get("name"):
        errors.append("spec.runtimeRef.name: required")
    trainer = spec.get("trainer") or {}
    reserved = sorted({e.get("name") for e in trainer.get("env") or []} & set(RESERVED_ENV))
    if reserved:
        errors.append(f"spec.trainer.env: must not have reserved envs {reserved}")
    if trainer.get("numNodes") is not None and trainer["numNodes"] < 1:
        errors.append("spec.trainer.numNodes: must be at least 1")
    managers = [p.get("manager") for p in spec.get("runtimePatches") or []]
    if len(managers) != len(set(managers)):
        errors.append("spec.runtimePatches: manager values must be unique (list-map key)")
    for manager in managers:
        host, sep, rest = (manager or "").partition("/")
        if not (sep and RFC1123_SUBDOMAIN.match(host) and _HTTP_PATH.match(rest)):
            errors.append(f"spec.runtimePatches.manager {manager!r}: must be a domain-prefixed path like acme.io/foo")
    for patch in spec.get("runtimePatches") or []:
        for rjob in _patched_jobs(patch):
            pod = ((rjob.get("template") or {}).get("spec") or {}).get("template") or {}
            for c in (pod.get("spec") or {}).get("containers") or []:
                if c.get("env") and c.get("name") in (TRAINER_CONTAINER, "dataset-initializer", "model-initializer"):
                    errors.append(f"spec.runtimePatches: env of container {c['name']!r} goes in spec.trainer.env")
    return errors


def _patched_jobs(patch: dict) -> list[dict]:
    template = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
    return template.get("replicatedJobs") or []


def trial_trainjob_dict(spec, runtime: str = DEFAULT_RUNTIME, *, early_stopping: bool = True) -> dict:
    """The TrainJob as a Katib trial template: no metadata.name/namespace (Katib sets them; the trial's
    job is named after the trial), overrides may hold ``${trialParameters.name}`` placeholders, and the
    trainer runs :func:`~llmft.components.lib.jobs.katib_trial.katib_trial_script` through ``sh -c``, as a
    PyTorchJob trial does: Katib wraps the ``node`` container's command the same way."""

    arguments = format_overrides(spec.overrides.items())
    unsafe = [a for a in [*arguments, spec.config_path or ""] if not shell_safe(a)]
    if unsafe:  # the same rule as the PyTorchJob trial: Katib wraps the command in `sh -c`
        raise ConfigError(
            f"Katib trial {spec.name!r}: arguments {unsafe} contain whitespace or shell characters, which break "
            "Katib's metrics-collector wrapper; remove them"
        )
    body = trainjob_to_dict(build_trainjob(spec, runtime))
    body["metadata"].pop("name", None)
    body["metadata"].pop("namespace", None)
    script = katib_trial_script(spec, early_stopping=early_stopping)
    body["spec"]["trainer"]["command"], body["spec"]["trainer"]["args"] = ["sh", "-c"], [script]
    return body
