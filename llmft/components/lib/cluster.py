"""The one thin module through which every Kubernetes call of this project goes.

``Cluster`` wraps the official ``kubernetes`` client (CustomObjectsApi + CoreV1Api)
and hands out a Training Operator ``TrainingClient`` that uses the same API
objects. It holds no business logic: builders (jobs/, serving/inferenceservice.py, the
Katib helper) make the objects, this module sends them.

Configuration is loaded lazily, on the first call: in-cluster (the pod's service
account) when running in a pod, else the kubeconfig (``KUBECONFIG`` or
``~/.kube/config``). Tests inject fakes for ``custom_api`` / ``core_api`` — the
kubernetes-client boundary — and everything above them runs for real.

API errors become ``ClusterError`` (an ``LlmftError``: the CLI prints it cleanly)
that names the object, the HTTP status, the server's message and the usual fix;
``ClusterError.status`` keeps the HTTP status (404, 409, ...) for callers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import urllib3

from llmft.trainer.errors import LlmftError, TransientError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where Kubernetes mounts a pod's service-account token and namespace."""

PYTORCHJOB_CONTAINER = "pytorch"
"""Container name the Training Operator requires in every PyTorchJob replica."""

_HINTS = {
    401: "the credentials were rejected: refresh your kubeconfig or the service-account token",
    403: "the service account lacks RBAC for this verb on this resource: grant it "
    "(see the cluster guide's RBAC manifest) or run as a user who has it",
    404: "not found: check the name and namespace; on create this means the CRD is not installed",
    409: "already exists (or was changed concurrently): delete it, pick another name, or replace it",
    422: "the API server rejected the object as invalid: fix the field it names",
}


TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses worth retrying (the API server or its proxy was busy or restarting)."""


class ClusterError(LlmftError):
    """A Kubernetes API call failed; ``status`` is its HTTP status (None when no response)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        """True when a retry may succeed: no answer at all (connection refused/reset) or a busy server."""
        return self.status is None or self.status in TRANSIENT_STATUSES


def call_with_retries(
    fn: Callable[[], Any],
    *,
    attempts: int = 5,
    wait_s: float = 2.0,
    what: str = "Kubernetes API call",
    print_fn: Callable[[str], Any] = print,
) -> Any:
    """``fn()``, retried up to ``attempts`` times (doubling waits) while it raises a transient
    ClusterError; a permanent error, or the last transient one, is raised."""

    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except ClusterError as exc:
            if not exc.transient or attempt == attempts:
                raise
            print_fn(f"warning: {what}: {exc} (attempt {attempt}/{attempts}; retrying in {wait_s:.0f}s)")
            time.sleep(wait_s)
            wait_s *= 2
    raise AssertionError("unreachable")


def _server_message(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    if not body:
        return str(getattr(exc, "reason", "") or exc)
    try:
        return str(json.loads(body).get("message", body))
    except (ValueError, AttributeError):
        return str(body)


def current_namespace(service_account_dir: Path = SERVICE_ACCOUNT_DIR, config_file: str | None = None) -> str:
    """The namespace to work in: the pod's own namespace when in a pod, else the
    kubeconfig's current-context namespace, else ``"default"``."""
    ns_file = Path(service_account_dir) / "namespace"
    if ns_file.is_file():
        namespace = ns_file.read_text().strip()
        if namespace:
            return namespace
    try:
        from kubernetes import config  # heavy: kubernetes

        _, active = config.list_kube_config_contexts(config_file=config_file)
        namespace = (active or {}).get("context", {}).get("namespace")
        if namespace:
            return str(namespace)
    except Exception:  # noqa: BLE001 - no kubeconfig is a normal case here
        pass
    return "default"


class Cluster:
    """Kubernetes API access for one default namespace.

    ``namespace``: default namespace of every call (``current_namespace()`` when None).
    ``api_client``: a configured ``kubernetes.client.ApiClient`` (loaded lazily when None).
    ``custom_api`` / ``core_api``: injected API objects (tests pass fakes here).
    ``config_file`` / ``context``: kubeconfig file and context, when not in a pod.
    """

    def __init__(
        self,
        namespace: str | None = None,
        *,
        api_client: Any = None,
        custom_api: Any = None,
        core_api: Any = None,
        authorization_api: Any = None,
        config_file: str | None = None,
        context: str | None = None,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    ):
        self._namespace = namespace
        self._api_client = api_client
        self._custom_api = custom_api
        self._core_api = core_api
        self._authorization_api = authorization_api
        self._config_file = config_file
        self._context = context
        self._service_account_dir = Path(service_account_dir)

    # -- lazily built clients -------------------------------------------------------------
    @property
    def namespace(self) -> str:
        if self._namespace is None:
            self._namespace = current_namespace(self._service_account_dir, self._config_file)
        return self._namespace

    def current_namespace(self) -> str:
        """The default namespace of this Cluster (see the module-level ``current_namespace``)."""
        return self.namespace

    @property
    def api_client(self):
        if self._api_client is None:
            self._api_client = self._load_api_client()
        return self._api_client

    @property
    def custom_api(self):
        if self._custom_api is None:
            from kubernetes import client  # heavy: kubernetes

            self._custom_api = client.CustomObjectsApi(self.api_client)
        return self._custom_api

    @property
    def core_api(self):
        if self._core_api is None:
            from kubernetes import client  # heavy: kubernetes

            self._core_api = client.CoreV1Api(self.api_client)
        return self._core_api

    @property
    def authorization_api(self):
        if self._authorization_api is None:
            from kubernetes import client  # heavy: kubernetes

            self._authorization_api = client.AuthorizationV1Api(self.api_client)
        return self._authorization_api

    def _load_api_client(self):
        from kubernetes import client, config  # heavy: kubernetes

        configuration = client.Configuration()
        in_pod = (self._service_account_dir / "token").is_file() and self._config_file is None
        try:
            if in_pod:
                config.load_incluster_config(client_configuration=configuration)
            else:
                config.load_kube_config(
                    config_file=self._config_file,
                    context=self._context,
                    client_configuration=configuration,
                    persist_config=False,
                )
        except Exception as exc:  # noqa: BLE001 - ConfigException, missing file, bad YAML
            where = (
                "the pod's service account"
                if in_pod
                else (self._config_file or os.environ.get("KUBECONFIG", "~/.kube/config"))
            )
            raise ClusterError(
                f"cannot load Kubernetes configuration from {where}: {exc}. "
                "Run inside the cluster, or set KUBECONFIG to a valid kubeconfig."
            ) from exc
        return client.ApiClient(configuration)

    # -- one wrapper for every call ---------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.rest import ApiException  # heavy: kubernetes

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            hint = _HINTS.get(exc.status, "check the cluster and retry")
            raise ClusterError(
                f"{what} failed: HTTP {exc.status}: {_server_message(exc)} ({hint})", status=exc.status
            ) from exc
        except urllib3.exceptions.HTTPError as exc:  # no answer: connection refused/reset, timeout
            raise ClusterError(f"{what} failed: the API server did not answer ({exc})", status=None) from exc

    # -- custom objects ---------------------------------------------------------------------
    def create_custom_object(
        self, group: str, version: str, plural: str, body: dict, namespace: str | None = None
    ) -> dict:
        ns = namespace or self.namespace
        name = (body.get("metadata") or {}).get("name", "?")
        return self._call(
            f"create {plural}.{group}/{version} {ns}/{name}",
            self.custom_api.create_namespaced_custom_object,
            group,
            version,
            ns,
            plural,
            body,
        )

    def get_custom_object(self, group: str, version: str, plural: str, name: str, namespace: str | None = None) -> dict:
        ns = namespace or self.namespace
        return self._call(
            f"get {plural}.{group}/{version} {ns}/{name}",
            self.custom_api.get_namespaced_custom_object,
            group,
            version,
            ns,
            plural,
            name,
        )

    def list_custom_objects(
        self, group: str, version: str, plural: str, label_selector: str | None = None, namespace: str | None = None
    ) -> list[dict]:
        ns = namespace or self.namespace
        kwargs = {"label_selector": label_selector} if label_selector else {}
        result = self._call(
            f"list {plural}.{group}/{version} in {ns}",
            self.custom_api.list_namespaced_custom_object,
            group,
            version,
            ns,
            plural,
            **kwargs,
        )
        return list(result.get("items", []))

    def replace_custom_object(
        self, group: str, version: str, plural: str, name: str, body: dict, namespace: str | None = None
    ) -> dict:
        ns = namespace or self.namespace
        return self._call(
            f"replace {plural}.{group}/{version} {ns}/{name}",
            self.custom_api.replace_namespaced_custom_object,
            group,
            version,
            ns,
            plural,
            name,
            body,
        )

    def patch_custom_object(
        self, group: str, version: str, plural: str, name: str, patch: dict, namespace: str | None = None
    ) -> dict:
        ns = namespace or self.namespace
        return self._call(
            f"patch {plural}.{group}/{version} {ns}/{name}",
            self.custom_api.patch_namespaced_custom_object,
            group,
            version,
            ns,
            plural,
            name,
            patch,
        )

    def delete_custom_object(
        self,
        group: str,
        version: str,
        plural: str,
        name: str,
        namespace: str | None = None,
        propagation: str = "Background",
    ) -> dict:
        """Delete with ``propagationPolicy: Background`` (default): the object goes at once and the
        garbage collector then deletes what it owns (a PyTorchJob's pods, an Experiment's trials).
        ``Foreground``: the object stays (``deletionTimestamp`` set) until every dependent that blocks
        its deletion is gone, so "the object is gone" means "its pods are gone" too."""
        ns = namespace or self.namespace
        return self._call(
            f"delete {plural}.{group}/{version} {ns}/{name}",
            self.custom_api.delete_namespaced_custom_object,
            group,
            version,
            ns,
            plural,
            name,
            propagation_policy=propagation,
        )

    # -- pods -------------------------------------------------------------------------------
    def list_pods(self, label_selector: str, namespace: str | None = None) -> list:
        """Pods (``kubernetes.client.V1Pod``) matching ``label_selector``."""
        ns = namespace or self.namespace
        result = self._call(
            f"list pods {label_selector!r} in {ns}",
            self.core_api.list_namespaced_pod,
            ns,
            label_selector=label_selector,
        )
        return list(result.items or [])

    def read_pod(self, name: str, namespace: str | None = None):
        """One pod (``kubernetes.client.V1Pod``)."""
        ns = namespace or self.namespace
        return self._call(f"read pod {ns}/{name}", self.core_api.read_namespaced_pod, name=name, namespace=ns)

    def list_events(self, involved_object: str, namespace: str | None = None) -> list:
        """Events (``CoreV1Event``) about the object named ``involved_object``, oldest first."""
        ns = namespace or self.namespace
        result = self._call(
            f"list events of {ns}/{involved_object}",
            self.core_api.list_namespaced_event,
            ns,
            field_selector=f"involvedObject.name={involved_object}",
        )
        return list(result.items or [])

    def may(self, verb: str, group: str, resource: str, namespace: str | None = None) -> bool:
        """Whether this service account may ``verb`` ``resource`` in ``namespace``: a
        SelfSubjectAccessReview, which any authenticated account may create (no RBAC needed)."""
        from kubernetes import client  # heavy: kubernetes

        ns = namespace or self.namespace
        attributes = client.V1ResourceAttributes(verb=verb, group=group, resource=resource, namespace=ns)
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes)
        )
        result = self._call(
            f"review {verb} {resource} in {ns}", self.authorization_api.create_self_subject_access_review, review
        )
        return bool(result.status and result.status.allowed)

    def read_config_map(self, name: str, namespace: str | None = None) -> dict:
        """The ``data`` of a ConfigMap (a Katib preflight reads Katib's own config)."""
        ns = namespace or self.namespace
        result = self._call(f"read configmap {ns}/{name}", self.core_api.read_namespaced_config_map, name, ns)
        return dict(result.data or {})

    def read_pod_log(
        self, name: str, container: str | None = None, tail_lines: int | None = None, namespace: str | None = None
    ) -> str:
        ns = namespace or self.namespace
        kwargs: dict[str, Any] = {}
        if container:
            kwargs["container"] = container
        if tail_lines is not None:
            kwargs["tail_lines"] = tail_lines
        return (
            self._call(
                f"read log of pod {ns}/{name}", self.core_api.read_namespaced_pod_log, name=name, namespace=ns, **kwargs
            )
            or ""
        )

    # -- Training Operator ------------------------------------------------------------------
    def training_client(self, job_kind: str = "PyTorchJob"):
        """A ``kubeflow.training.TrainingClient`` whose API calls go through this Cluster's
        ``custom_api`` and ``core_api`` (so one configuration, and one fake in tests)."""
        from kubeflow.training import TrainingClient  # heavy: kubeflow
        from kubernetes import client  # heavy: kubernetes

        custom_api, core_api = self.custom_api, self.core_api  # loads the configuration if needed
        configuration = getattr(self._api_client, "configuration", None) or client.Configuration()
        training = TrainingClient(client_configuration=configuration, namespace=self.namespace, job_kind=job_kind)
        training.custom_api, training.core_api = custom_api, core_api
        return training


RECREATE_WAIT_S = 300.0
"""How long a retry waits for a failed job (and its terminating pods) to go before recreating it."""


def wait_until_gone(what: str, exists, pods, *, timeout_s: float = RECREATE_WAIT_S, poll_s: float = 5.0) -> None:
    """Poll until ``exists()`` is false and ``pods()`` (names) is empty; else a TransientError naming them.

    A job deleted with background propagation vanishes at once while its pods still run their
    grace period (Kubernetes garbage collection: kubernetes.io/docs/concepts/architecture/
    garbage-collection). A new job of the same name then meets them: the operator cannot create
    pods under the same names (AlreadyExists), and a terminating trainer still writing its SIGTERM
    checkpoint would share the run directory with the new one. Foreground deletion keeps the job
    until its pods (``blockOwnerDeletion``: Training Operator v1.9.4 job_controller.go 222-233) are
    gone; the pod check also covers pods that do not block it."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [what] if exists() else []
        left += [f"pod {p}" for p in pods()]
        if not left:
            return
        if time.monotonic() > deadline:
            raise TransientError(
                f"{what} from an earlier attempt was not gone within {timeout_s:.0f}s (still there: "
                f"{', '.join(left)}); a new one under the same name would collide with it. A pod stuck "
                "Terminating on a lost node needs `kubectl delete pod <pod> --grace-period=0 --force`; then retry."
            )
        time.sleep(poll_s)
