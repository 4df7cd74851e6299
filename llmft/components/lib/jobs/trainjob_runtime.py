"""Read and check the (Cluster)TrainingRuntime a TrainJob references, the way the Kubeflow SDK reads it.

``KubernetesBackend.get_runtime`` (PyPI ``kubeflow`` 0.5.0,
``kubeflow/trainer/backends/kubernetes/backend.py`` 183-232) reads the namespaced
``TrainingRuntime`` first and falls back to the cluster-scoped ``ClusterTrainingRuntime`` only on
a 404 (185-207); any other error of the namespaced read (a 403 among them) is raised at once as
``RuntimeError("Failed to get TrainingRuntime: <ns>/<name>")`` (203-207), any error of the cluster
read as ``RuntimeError("Failed to get Runtime: <name> (checked both namespaced and cluster scope)")``
(229-232), the ``ApiException`` as its ``__cause__``; an API call that does not answer within
``DEFAULT_TIMEOUT`` (120 s, ``kubeflow/common/constants.py`` 19) raises ``TimeoutError`` (199-202,
225-228). The same ``get_runtime`` runs on every status poll of the TrainJob (``get_job`` ->
``__get_trainjob_from_cr``, 673), so a namespaced TrainingRuntime with the runtime's name
*shadows* the ClusterTrainingRuntime for the SDK, while the TrainJob controller runs what the
job's ``runtimeRef.kind`` names.

A ClusterTrainingRuntime is cluster-scoped: a namespaced Role cannot grant it. Upstream grants
``get/list/watch`` on it to ``system:authenticated`` only in its kubeflow-platform overlay
(kubeflow/trainer v2.3.0 ``manifests/overlays/kubeflow-platform/kubeflow-trainer-roles.yaml``
83-108); a standalone KFP + Trainer install has no such binding, so deploy/ ships
:data:`CLUSTER_RBAC_FILE`.

:func:`check_runtime` turns every way the read fails into one line naming the cause and the fix:
forbidden (the verb, the resource, the deploy/ file that grants it), not installed (no CRD),
missing, shadowed, invalid, not a torch runtime, or no answer (TimeoutError -> TransientError).
"""

from __future__ import annotations

from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.cluster import TRANSIENT_STATUSES, Cluster, _server_message
from llmft.components.lib.jobs.trainjob_spec import parse_runtime_ref
from llmft.trainer.errors import ConfigError, TransientError

RBAC_FILES = {
    "clustertrainingruntimes": "deploy/cluster-role.yaml",
    "trainingruntimes": "deploy/role.yaml",
}
"""Resource -> the deploy/ manifest that grants the pipeline's service account ``get`` on it."""
CLUSTER_RBAC_FILE = RBAC_FILES["clustertrainingruntimes"]
RUNTIME_VERBS = ("get", "list")
"""What the SDK does with runtimes: ``get_runtime`` gets, ``list_runtimes`` lists."""
_CLUSTER_STEP_MARK = "checked both namespaced and cluster scope"
"""Text of the SDK's RuntimeError for a failed cluster-scoped read (backend.py 230-231)."""


def _api_status(exc: BaseException) -> tuple[int | None, str]:
    """(HTTP status, server message) of the ApiException behind the SDK's RuntimeError."""

    cause = exc.__cause__
    status = getattr(cause, "status", None)
    return (int(status) if status else None), (_server_message(cause) if isinstance(cause, Exception) else str(exc))


def explain_read_error(exc: RuntimeError, kind: str, name: str, namespace: str) -> Exception:
    """The SDK's RuntimeError from ``get_runtime`` -> ConfigError (or TransientError for a busy server)."""

    status, message = _api_status(exc)
    cluster_step = _CLUSTER_STEP_MARK in str(exc)
    resource = "clustertrainingruntimes" if cluster_step else "trainingruntimes"
    where = "at the cluster scope" if cluster_step else f"in namespace {namespace}"
    what = f"training runtime {kind}/{name}"
    if status == 403:
        order = "" if cluster_step else " (the Kubeflow SDK reads the namespaced TrainingRuntime first)"
        return ConfigError(
            f"{what}: forbidden (HTTP 403): the pipeline's service account may not `get` "
            f"{resource}.trainer.kubeflow.org {where}{order}. Apply {RBAC_FILES[resource]} "
            f"(kubectl apply -k deploy/; set PIPELINE_SERVICE_ACCOUNT in deploy/params.env). Server: {message}"
        )
    if status == 404 and f'"{name}" not found' not in message:
        return ConfigError(
            f"{what}: Kubeflow Trainer v2 is not installed (the API server does not serve "
            f"{resource}.trainer.kubeflow.org: HTTP 404). Install Kubeflow Trainer v2 with its default runtimes, "
            "or use training_backend=pytorchjob (a PyTorchJob)"
        )
    if status == 404:
        return ConfigError(
            f"{what} does not exist: neither a TrainingRuntime in namespace {namespace} nor a ClusterTrainingRuntime "
            f"is named {name!r}. Install Kubeflow Trainer v2's "
            "default runtimes, or name an existing runtime with the training_runtime parameter "
            "(`kubectl get clustertrainingruntimes,trainingruntimes -A`)"
        )
    if status in TRANSIENT_STATUSES:
        return TransientError(f"{what}: the API server answered HTTP {status} ({message}); re-run the step")
    return ConfigError(f"{what} is not usable: {message}. Fix the runtime or name another with training_runtime")


def shadow_error(kind: str, name: str, namespace: str, found: str) -> ConfigError:
    """Asked for one kind, the SDK's namespaced-first read returned the other."""
    if found == "TrainingRuntime":
        return ConfigError(
            f"training runtime {name!r}: TrainingRuntime {namespace}/{name} shadows ClusterTrainingRuntime {name}. "
            "The Kubeflow SDK reads the namespaced runtime first, on every status poll, while the TrainJob runs the "
            f"ClusterTrainingRuntime: rename or delete TrainingRuntime {namespace}/{name}, or run it with "
            f"training_runtime=TrainingRuntime/{name}"
        )
    return ConfigError(
        f"training runtime TrainingRuntime/{name}: namespace {namespace} has none (a ClusterTrainingRuntime "
        f"{name} exists: name it training_runtime={name})"
    )


def get_runtime(backend, kind: str, name: str):
    """``backend.get_runtime(name)`` with every failure as one line (ConfigError / TransientError)."""
    try:
        return backend.get_runtime(name)
    except TimeoutError as exc:
        raise TransientError(
            f"training runtime {kind}/{name}: the Kubernetes API did not answer within the Kubeflow SDK's timeout "
            f"({exc}); the API server is overloaded or unreachable: re-run the step"
        ) from None
    except RuntimeError as exc:
        raise explain_read_error(exc, kind, name, backend.namespace) from None


def check_runtime(backend, kind: str, name: str) -> None:
    """The runtime is readable, is the kind asked for (not shadowed), and runs torchrun (PET_* rendezvous):
    an MPI runtime such as ``deepspeed-distributed`` runs ``mpirun`` on a launcher instead, which
    ``llmft train`` is not."""
    runtime = get_runtime(backend, kind, name)
    if runtime.kind.value != kind:
        raise shadow_error(kind, name, backend.namespace, runtime.kind.value)
    from kubeflow.trainer.constants import constants as sdk  # heavy: kubeflow

    if tuple(runtime.trainer.command) != tuple(sdk.TORCH_COMMAND):  # the SDK's mark of mlPolicy.torch
        raise ConfigError(
            f"training runtime {name!r} (framework {runtime.trainer.framework}) does not launch torchrun; "
            "`llmft train` needs a torch runtime (mlPolicy.torch, e.g. torch-distributed), which sets torchrun's "
            "PET_* rendezvous; DeepSpeed runs under it with distributed.backend=deepspeed"
        )


def preflight_runtime(plan, cluster=None) -> None:
    """The trainjob backend's preflight (its registry entry, llmft/components/lib/jobs/backends.py): the plan step,
    on a cluster, runs :func:`check_runtime` with the pipeline's service account, before any GPU is requested."""
    cluster = cluster or cluster_module.Cluster()
    check_runtime(sdk_backend(cluster), *parse_runtime_ref(plan.job.runtime))


def sdk_backend(cluster: Cluster, namespace: str | None = None):
    """The Kubeflow SDK's ``KubernetesBackend`` (what ``TrainerClient`` delegates every call to) on
    ``cluster``'s API objects, in ``namespace`` (default: the cluster's)."""
    from kubeflow.trainer.backends.kubernetes.backend import KubernetesBackend  # heavy: kubeflow

    class SdkBackend(KubernetesBackend):
        def __init__(self):  # the SDK's __init__ loads a kubeconfig itself; the Cluster already has one
            self.custom_api, self.core_api = cluster.custom_api, cluster.core_api
            self.namespace = namespace or cluster.namespace
            self.verify_backend()

    return SdkBackend()
