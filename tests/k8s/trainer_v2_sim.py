"""A simulator of Kubeflow Trainer v2.3.0 for tests: TrainJob + runtime -> JobSet -> node pods, and
fakes at the kubernetes-client boundary for what the Kubeflow SDK's backend calls.

:func:`build_jobset` follows the controller's build of a TrainJob (kubeflow/trainer at v2.3.0):

- ``pkg/runtime/core/trainingruntime.go`` 251-290 ``mergeRuntimePatches``: each runtime patch's
  JobSet spec strategic-merged onto the runtime's (ReplicatedJobs merge by ``name``: jobset v0.12.0
  ``api/jobset/v1alpha2/jobset_types.go`` 124-127; the core/v1 lists by their ``patchMergeKey``
  tags in k8s.io/api ``core/v1/types.go``: containers, volumes, env, imagePullSecrets by name,
  volumeMounts by mountPath; tolerations have no patch strategy and are replaced);
- ``trainingruntime.go`` 186-236: the trainer node count (mlPolicy.numNodes) and
  ``resourcesPerNode`` strategic-merged into the ``node`` container
  (``pkg/util/trainingruntime/trainingruntime.go`` 47-65);
- ``pkg/runtime/framework/plugins/torch/torch.go`` 110-204: ``trainer.numNodes``, ``trainer.env``,
  PET_NNODES / PET_NPROC_PER_NODE / PET_NODE_RANK / PET_MASTER_ADDR / PET_MASTER_PORT and port 29500
  on the trainer's ``node`` container (mlPolicy.torch only);
- ``pkg/runtime/framework/plugins/jobset/builder.go`` 113-155: image, command, args and env of
  ``trainer`` into the ``node`` container of the job labelled ancestor ``trainer``;
- ``jobset.go`` 302-323 ``SyncParallelCount``: parallelism = completions = the node count;
- JobSet's defaulting webhook (jobset v0.12.0 ``pkg/webhooks/jobset_webhook.go`` 111-127):
  completionMode Indexed, pod restartPolicy OnFailure.

The fakes extend tests/k8s/k8s_fakes.py with what ``KubernetesBackend`` needs: cluster-scoped
objects (ClusterTrainingRuntimes loaded from ../shared/k8s-crds), set-based label selectors,
``previous`` container logs, and the Trainer's public ConfigMap.

Not traced to a line (encoded from the label and field names, not from a checked line): :func:`node_pods`'s
labels (``jobset.sigs.k8s.io/*``, ``batch.kubernetes.io/job-completion-index``) and hostname/subdomain.
Test choices: the pod-name suffix ``-abcde`` stands for the Job controller's random one; the JobSet and
Job controllers are not run (pod phases, restarts and logs are set by the tests); the fakes' error
messages beyond the status codes the SDK branches on.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import yaml
from k8s_fakes import FakeCoreV1Api, FakeCustomObjectsApi, _AsyncResult, _maybe_async, api_error, wire
from kubernetes import client

ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
NODE = "node"
TRAINER_PORT = 29500  # pkg/constants/constants.go 72
MERGE_KEYS = {
    "replicatedJobs": "name",
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


def load_runtime(crd_dir: Path, name: str) -> dict:
    """A shipped runtime file, e.g. ``torch_distributed`` (trainer-runtime-torch_distributed.yaml)."""
    return yaml.safe_load((crd_dir / f"trainer-runtime-{name}.yaml").read_text())


def strategic_merge(base, patch):
    """A strategic merge patch of JSON values with the merge keys above (other lists are replaced)."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, MERGE_KEYS[key])
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = strategic_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(base: list, patch: list, key: str) -> list:
    out = copy.deepcopy(base)
    for item in patch:
        match = next((i for i, b in enumerate(out) if b.get(key) == item.get(key)), None)
        if match is None:
            out.append(copy.deepcopy(item))
        else:
            out[match] = strategic_merge(out[match], item)
    return out


def _upsert_env(env: list, items: list) -> None:
    for item in items:
        match = next((i for i, e in enumerate(env) if e["name"] == item["name"]), None)
        if match is None:
            env.append(copy.deepcopy(item))
        else:
            env[match] = copy.deepcopy(item)


def build_jobset(runtime: dict, trainjob: dict) -> dict:
    """The JobSet spec the v2.3.0 controller builds from ``runtime`` and ``trainjob`` (dicts)."""
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    for patch in trainjob["spec"].get("runtimePatches") or []:
        patch_spec = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec")
        if patch_spec:
            spec = strategic_merge(spec, patch_spec)
    ml = runtime["spec"].get("mlPolicy") or {}
    trainer = trainjob["spec"].get("trainer") or {}
    launcher_as_node = bool((ml.get("mpi") or {}).get("runLauncherAsNode"))
    for rjob in spec["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        is_trainer = ((rjob["template"].get("metadata") or {}).get("labels") or {}).get(ANCESTOR_LABEL) == "trainer"
        count = job_spec.get("parallelism", 1)
        if is_trainer:
            count = ml.get("numNodes", 1)
            if "torch" in ml and trainer.get("numNodes"):
                count = trainer["numNodes"]
        container = next((c for c in job_spec["template"]["spec"]["containers"] if c["name"] == NODE), None)
        if container is not None and (is_trainer or (launcher_as_node and rjob["name"] == NODE)):
            if trainer.get("resourcesPerNode"):
                container["resources"] = strategic_merge(container.get("resources") or {}, trainer["resourcesPerNode"])
            env = container.setdefault("env", [])
            if "torch" in ml and is_trainer:
                _torch_env(env, trainjob, count, trainer)
                ports = container.setdefault("ports", [])
                if not any(p.get("containerPort") == TRAINER_PORT for p in ports):
                    ports.append({"containerPort": TRAINER_PORT})
            if is_trainer:
                container.update({k: trainer[k] for k in ("image", "command", "args") if trainer.get(k)})
            _upsert_env(env, trainer.get("env") or [])
            if not env:
                container.pop("env")
        job_spec["parallelism"] = job_spec["completions"] = count
        job_spec.setdefault("completionMode", "Indexed")
        job_spec["template"]["spec"].setdefault("restartPolicy", "OnFailure")
    return spec


def _torch_env(env: list, trainjob: dict, count: int, trainer: dict) -> None:
    name = trainjob["metadata"]["name"]
    nproc = str(trainer["numProcPerNode"]) if trainer.get("numProcPerNode") else "auto"
    _upsert_env(env, trainer.get("env") or [])
    _upsert_env(
        env,
        [
            {"name": "PET_NNODES", "value": str(count)},
            {"name": "PET_NPROC_PER_NODE", "value": nproc},
            {
                "name": "PET_NODE_RANK",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
                },
            },
            {"name": "PET_MASTER_ADDR", "value": f"{name}-{NODE}-0-0.{name}"},
            {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)},
        ],
    )


def node_pods(jobset: dict, name: str, namespace: str) -> list[dict]:
    """The pods the trainer's replicated job creates: one per node, labelled as JobSet and Job label them."""
    rjob = next(r for r in jobset["replicatedJobs"] if r["name"] == NODE)
    template = rjob["template"]["spec"]["template"]
    pods = []
    for index in range(rjob["template"]["spec"]["completions"]):
        labels = {
            **((template.get("metadata") or {}).get("labels") or {}),
            "jobset.sigs.k8s.io/jobset-name": name,
            "jobset.sigs.k8s.io/replicatedjob-name": NODE,
            "jobset.sigs.k8s.io/job-index": "0",
            "batch.kubernetes.io/job-completion-index": str(index),
        }
        metadata = {
            "name": f"{name}-{NODE}-0-{index}-abcde",
            "namespace": namespace,
            "labels": labels,
            "annotations": {
                **((template.get("metadata") or {}).get("annotations") or {}),
                "batch.kubernetes.io/job-completion-index": str(index),
            },
            "creationTimestamp": now_utc(),
        }
        pod_spec = {**copy.deepcopy(template["spec"]), "hostname": f"{name}-{NODE}-0-{index}", "subdomain": name}
        pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec})
    return pods


# --- fakes at the kubernetes-client boundary --------------------------------------------------------


def now_utc() -> str:
    import datetime

    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def wire_name(body) -> str:
    return wire(body)["metadata"]["name"]


class _Response:
    def __init__(self, data: dict):
        self.data = json.dumps(data)


def to_v1(data: dict, kind: str):
    """A JSON dict as the kubernetes client's model ``kind`` (e.g. V1Pod), as it deserializes responses."""
    return client.ApiClient().deserialize(_Response(data), kind)


def forbidden(plural: str, group: str, name: str, namespace: str | None) -> Exception:
    """The API server's 403 for a verb RBAC does not grant (k8s.io/apiserver
    ``pkg/endpoints/handlers/responsewriters/errors.go`` ``ForbiddenStatusError``)."""
    where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    user = 'User "system:serviceaccount:team-a:default-editor"'
    return api_error(
        403,
        f'{plural}.{group} "{name}" is forbidden: {user} cannot get resource "{plural}" in API group "{group}" {where}',
    )


def _raise(error: Exception):
    raise error


class _TimedOut:
    """What ``async_req=True`` returns when the server does not answer: ``get(timeout)`` raises
    ``multiprocessing.TimeoutError`` (multiprocessing.pool.ApplyResult.get)."""

    def get(self, timeout=None):
        import multiprocessing

        raise multiprocessing.TimeoutError()


class FakeTrainerCustomApi(FakeCustomObjectsApi):
    """Custom objects plus cluster-scoped ones (ClusterTrainingRuntimes); created objects get a creationTimestamp.
    Reads of a plural in ``forbidden`` answer 403 (RBAC), of one in ``unanswered`` time out; a plural in
    ``unserved`` (no CRD) answers 404 at both scopes."""

    def __init__(self, cluster_objects: dict | None = None, on_get=None):
        super().__init__(on_get)
        self.cluster_objects = dict(cluster_objects or {})
        self.forbidden: set[str] = set()
        self.unanswered: set[str] = set()

    def _blocked(self, plural: str, group: str, name: str, namespace: str | None, async_req: bool):
        """A read RBAC forbids or the server does not answer: what the client returns, or None."""
        if plural in self.unanswered and async_req:
            return _TimedOut()
        if plural in self.forbidden:
            error = forbidden(plural, group, name, namespace)
            if not async_req:
                raise error
            return _AsyncResult(_raise, error)  # raised by get(), as the real client does
        return None

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, async_req=False, **_):
        blocked = self._blocked(plural, group, name, namespace, async_req)
        if blocked is not None:
            return blocked
        return super().get_namespaced_custom_object(group, version, namespace, plural, name, async_req=async_req)

    def get_cluster_custom_object(self, group, version, plural, name, async_req=False, **_):
        self.calls.append(("get-cluster", group, version, plural, name))
        blocked = self._blocked(plural, group, name, None, async_req)
        if blocked is not None:
            return blocked
        return (
            _AsyncResult(self._get_cluster, plural, group, name)
            if async_req
            else self._get_cluster(plural, group, name)
        )

    def _get_cluster(self, plural, group, name):
        self._read(plural)
        if (plural, name) not in self.cluster_objects:
            raise api_error(404, f'{plural}.{group} "{name}" not found')
        return copy.deepcopy(self.cluster_objects[(plural, name)])

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kwargs):
        result = super().create_namespaced_custom_object(group, version, namespace, plural, body, **kwargs)
        stored = self.objects.get((group, version, namespace, plural, wire_name(body)))
        if stored is not None:  # the API server sets it; the SDK's get_job requires it
            stored["metadata"].setdefault("creationTimestamp", now_utc())
        return result


_SET_SELECTOR = re.compile(r"^\s*([^\s=!]+)\s+in\s+\(([^)]*)\)\s*$")


def selector_matches(labels: dict, selector: str | None) -> bool:
    """Equality (``a=b``) and set-based (``a in (x, y)``) label selectors, comma-joined."""
    if not selector:
        return True
    for part in re.split(r",(?![^(]*\))", selector):
        found = _SET_SELECTOR.match(part)
        if found:
            if labels.get(found.group(1)) not in [v.strip() for v in found.group(2).split(",")]:
                return False
        else:
            key, _, value = part.partition("=")
            if labels.get(key.strip()) != value.strip():
                return False
    return True


class FakeTrainerCoreApi(FakeCoreV1Api):
    """Pods with full specs and container statuses, current and previous logs, the Trainer's ConfigMap."""

    def __init__(self):
        super().__init__()
        self.previous_logs: dict[tuple[str, str], str] = {}

    def add_full_pod(self, pod: dict, phase: str = "Running") -> None:
        v1 = to_v1({**pod, "status": {"phase": phase}}, "V1Pod")
        self.pods.setdefault(pod["metadata"]["namespace"], []).append(v1)
        self.logs[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = ""

    def pod(self, namespace: str, name: str):
        return next(p for p in self.pods.get(namespace, []) if p.metadata.name == name)

    @_maybe_async
    def list_namespaced_pod(self, namespace, label_selector=None, **_):
        items = [p for p in self.pods.get(namespace, []) if selector_matches(p.metadata.labels or {}, label_selector)]
        return client.V1PodList(items=items)

    def read_namespaced_pod_log(self, name, namespace, container=None, tail_lines=None, previous=False, **kwargs):
        if not previous:
            return super().read_namespaced_pod_log(name, namespace, container=container, tail_lines=tail_lines)
        self.log_reads.append({"name": name, "namespace": namespace, "container": container, "previous": True})
        if (namespace, name) not in self.previous_logs:
            raise api_error(400, f'previous terminated container "{container}" in pod "{name}" not found')
        text = self.previous_logs[(namespace, name)]
        return "\n".join(text.splitlines()[-tail_lines:]) if tail_lines is not None else text

    def read_namespaced_config_map(self, name, namespace, **_):
        return client.V1ConfigMap(data={"kubeflow_trainer_version": "v2.3.0"})


# --- plans -----------------------------------------------------------------------------------------

RUN_ID = "0f8e6a2c-1d2b-4c3e-9f00-123456789abc"
KFP_TASK_POD = {"KFP_POD_NAME": "llm-finetune-abcde-system-container-impl-123"}


def make_plan(*, hpo: bool = False, **changes):
    """The plan a cluster's plan-run step builds from the pipeline's defaults with ``changes``."""
    from llmft.components.lib.plan.build import build_plan
    from llmft.components.lib.plan.checks import compiled_settings
    from llmft.components.lib.plan.parameters import parameter_defaults

    values = {**parameter_defaults(), "mlflow_tracking_uri": "http://mlflow.mlflow:5000", **changes}
    compiled = compiled_settings("llm-finetune-hpo" if hpo else "llm-finetune", values)
    return build_plan(values, run_id=RUN_ID, compiled=compiled, environ=KFP_TASK_POD)
