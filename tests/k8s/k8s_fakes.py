"""Fakes at the kubernetes-client boundary: CustomObjectsApi and CoreV1Api.

They keep objects in memory, answer with the same shapes (dicts, V1PodList, str)
and the same errors (``ApiException`` with a status and a JSON body) as the real
API objects, and support ``async_req=True`` the way the TrainingClient calls them.
Bodies sent as SDK models are serialized with the real kubernetes ApiClient, i.e.
exactly what would go over the wire.

Where each API-server behaviour comes from (kubernetes, checked in the stored source of
kubernetes/kubernetes; the client is kubernetes 30.1.0):

- create sets ``generation`` 1 (``staging/src/k8s.io/apiextensions-apiserver/pkg/registry/customresource/
  strategy.go`` ``PrepareForCreate``); a replace keeps the stored ``status`` (the status subresource, which the
  CRDs in ../shared/k8s-crds enable) and raises ``generation`` by one when anything but metadata changed
  (``PrepareForUpdate``: here, when ``spec`` changed);
- a replace whose ``resourceVersion`` is not the stored one is a 409 (optimistic concurrency,
  ``staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go`` ``Update``; the message is
  shortened from ``OptimisticLockErrorMsg``); a second create of a name is 409 ``... already exists`` and a
  missing object 404 ``... not found`` (``staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go``
  ``NewAlreadyExists`` / ``NewNotFound``), each as a ``metav1.Status`` body;
- foreground deletion (``delete_namespaced_custom_object``: ``store.go``
  ``updateForGracefulDeletionAndFinalizers``).

Not traced to source (test choices): resourceVersions are increasing integers from 101 and uids are
``uid-<name>-<n>`` (the real ones are opaque); a patch is a recursive JSON merge (no strategic merge,
no ``null`` deletes); label selectors support ``k=v`` and ``k`` terms only (tests/k8s/trainer_v2_sim.py adds set-based
ones); ``fail_next``'s 503 body is made up.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from fake_clock import rfc3339_now
from kubernetes import client
from kubernetes.client.rest import ApiException


def api_error(status: int, message: str) -> ApiException:
    exc = ApiException(
        status=status,
        reason={400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict"}.get(status, "Error"),
    )
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return exc


class _AsyncResult:
    """What the real client returns for async_req=True (a thread-pool AsyncResult)."""

    def __init__(self, fn, *args, **kwargs):
        self._value, self._error = None, None
        try:
            self._value = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised on get(), like AsyncResult
            self._error = exc

    def get(self, timeout=None):
        if self._error is not None:
            raise self._error
        return self._value


def _maybe_async(method):
    def wrapper(self, *args, async_req=False, **kwargs):
        if async_req:
            return _AsyncResult(method, self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return wrapper


def wire(body) -> dict:
    """The JSON the real client would send for ``body`` (a dict or an SDK model)."""
    return json.loads(json.dumps(client.ApiClient().sanitize_for_serialization(body)))


class FakeCustomObjectsApi:
    """In-memory custom objects. ``on_get(obj, count)`` may mutate a stored object's
    status on its count-th GET (scripting a controller). A controller simulator
    (cluster_sim.py) plugs in through ``before_read`` (called before every get and list)
    and ``on_delete(key, obj)``; admission webhooks through ``admission(operation, plural, body, old)``
    (CREATE or UPDATE; returns the mutated body or raises the webhook's ApiException; kserve_admission.py).
    ``fail_next(n, status)`` makes the next ``n`` gets and lists fail with that HTTP status (an API server
    that blinks)."""

    def __init__(self, on_get: Callable[[dict, int], None] | None = None):
        self.objects: dict[tuple, dict] = {}
        self.calls: list[tuple] = []
        self.gets: Counter = Counter()
        self.on_get = on_get
        self.before_read: Callable[[], None] | None = None
        self.on_delete: Callable[[tuple, dict], None] | None = None
        self.admission: Callable[[str, str, dict, dict | None], dict] | None = None
        self.dependents: Callable[[tuple, dict], list] | None = None  # a deleted object's blocking dependents
        self.failures: list[int] = []
        self.propagations: list[str | None] = []  # propagationPolicy of every delete call
        self.unserved: set[str] = set()  # plurals whose CRD is not installed: 404 on every call
        self._version = 100

    def fail_next(self, count: int, status: int = 503) -> None:
        self.failures += [status] * count

    def _read(self, plural: str) -> None:
        if plural in self.unserved:
            raise api_error(404, f"the server could not find the requested resource ({plural})")
        if self.failures:
            status = self.failures.pop(0)
            raise api_error(status, "the server is currently unable to handle the request")
        if self.before_read is not None:
            self.before_read()

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    @_maybe_async
    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **_):
        body = wire(body)
        key = (group, version, namespace, plural, body["metadata"]["name"])
        self.calls.append(("create", *key, body))
        if key in self.objects:
            raise api_error(409, f'{plural}.{group} "{key[-1]}" already exists')
        if self.admission is not None:  # mutating, then validating webhooks (before the object is stored)
            body = self.admission("CREATE", plural, copy.deepcopy(body), None)
        stored = copy.deepcopy(body)
        stored["metadata"].update(
            namespace=namespace,
            resourceVersion=self._next_version(),
            generation=1,
            uid=f"uid-{key[-1]}-{self._version}",
        )
        self.objects[key] = stored
        return copy.deepcopy(stored)

    @_maybe_async
    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_):
        key = (group, version, namespace, plural, name)
        self.calls.append(("get", *key))
        self._read(plural)
        if key not in self.objects:
            raise api_error(404, f'{plural}.{group} "{name}" not found')
        self.gets[key] += 1
        if self.on_get is not None:
            self.on_get(self.objects[key], self.gets[key])
        return copy.deepcopy(self.objects[key])

    @_maybe_async
    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector=None, **_):
        self.calls.append(("list", group, version, namespace, plural, label_selector))
        self._read(plural)
        items = [
            copy.deepcopy(o)
            for (g, v, ns, p, _n), o in self.objects.items()
            if (g, v, ns, p) == (group, version, namespace, plural)
            and _labels_match(o["metadata"].get("labels") or {}, label_selector)
        ]
        return {"items": items}

    @_maybe_async
    def replace_namespaced_custom_object(self, group, version, namespace, plural, name, body, **_):
        body = wire(body)
        key = (group, version, namespace, plural, name)
        self.calls.append(("replace", *key, body))
        current = self.objects.get(key)
        if current is None:
            raise api_error(404, f'{plural}.{group} "{name}" not found')
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise api_error(409, "the object has been modified; please apply your changes to the latest version")
        if self.admission is not None:
            body = self.admission("UPDATE", plural, copy.deepcopy(body), copy.deepcopy(current))
        stored = copy.deepcopy(body)
        stored["metadata"].update(
            resourceVersion=self._next_version(),
            uid=current["metadata"]["uid"],
            generation=current["metadata"]["generation"] + (body.get("spec") != current.get("spec")),
        )
        stored["status"] = current.get("status", {})
        self.objects[key] = stored
        return copy.deepcopy(stored)

    @_maybe_async
    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **_):
        key = (group, version, namespace, plural, name)
        self.calls.append(("patch", *key, body))
        if key not in self.objects:
            raise api_error(404, f'{plural}.{group} "{name}" not found')
        _merge(self.objects[key], wire(body))
        return copy.deepcopy(self.objects[key])

    @_maybe_async
    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, propagation_policy=None, **_):
        """Background (or no policy): the object goes at once; the garbage collector deletes its
        dependents afterwards (``on_delete``). Foreground, with a controller behind ``on_delete``:
        the object stays, with ``deletionTimestamp`` and the ``foregroundDeletion`` finalizer, until
        that controller has seen its blocking dependents go (``dependents``; none: it goes at once)
        (apiserver registry/generic/registry/store.go
        ``updateForGracefulDeletionAndFinalizers``; kubernetes.io/docs/concepts/architecture/garbage-collection)."""
        key = (group, version, namespace, plural, name)
        self.calls.append(("delete", *key))
        self.propagations.append(propagation_policy)
        if key not in self.objects:
            raise api_error(404, f'{plural}.{group} "{name}" not found')
        if propagation_policy == "Foreground" and self.on_delete is not None:
            deleted = self.objects[key]
            if not deleted["metadata"].get("deletionTimestamp"):
                deleted["metadata"].update(deletionTimestamp=rfc3339_now(), finalizers=["foregroundDeletion"])
                self.on_delete(key, deleted)
            if not (self.dependents and self.dependents(key, deleted)):  # nothing blocks it: the GC drops the
                self.objects.pop(key, None)  # foregroundDeletion finalizer at once
            return {"kind": "Status", "status": "Success"}
        deleted = self.objects.pop(key)
        if self.on_delete is not None:
            self.on_delete(key, deleted)
        return {"kind": "Status", "status": "Success"}

    def created(self, plural: str) -> list[dict]:
        """Bodies of every create call for ``plural``, in order."""
        return [c[-1] for c in self.calls if c[0] == "create" and c[4] == plural]

    def sent(self, plural: str) -> list[dict]:
        """Bodies of every create and replace call for ``plural``, in order (as sent, before admission)."""
        return [c[-1] for c in self.calls if c[0] in ("create", "replace") and c[4] == plural]


def _merge(target: dict, patch: dict) -> None:
    """A JSON merge patch (RFC 7386, what the client sends for custom objects): null removes a key."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


def _labels_match(labels: dict | None, selector: str | None) -> bool:
    """``k=v`` terms, and bare ``k`` (the label exists)."""
    if not selector:
        return True
    labels = labels or {}
    terms = [part.split("=", 1) for part in selector.split(",")]
    return all(labels.get(t[0]) == t[1] if len(t) == 2 else t[0] in labels for t in terms)


class FakeCoreV1Api:
    """Pods, their logs and events. A pod in phase Pending has no log yet (HTTP 400, like the API).
    A log may be a ``Path`` (a simulated container's log file, read when asked for); ``before_read``
    lets a simulator refresh pod statuses before every read."""

    def __init__(self):
        self.pods: dict[str, list] = {}
        self.logs: dict[tuple[str, str], object] = {}
        self.log_reads: list[dict] = []
        self.events: dict[str, list] = {}
        self.config_maps: dict[tuple[str, str], dict] = {}  # (namespace, name) -> data
        self.claims: set[tuple[str, str]] = set()  # (namespace, name) of the PVCs that exist
        self.claim_details: dict[tuple[str, str], dict] = {}
        self.before_read: Callable[[], None] | None = None

    def add_event(
        self, namespace: str, involved: str, reason: str, message: str, type_: str = "Warning", uid: str | None = None
    ) -> None:
        count = len(self.events.get(namespace, []))
        self.events.setdefault(namespace, []).append(
            client.CoreV1Event(
                metadata=client.V1ObjectMeta(name=f"{involved}.{count}", namespace=namespace),
                involved_object=client.V1ObjectReference(kind="Pod", name=involved, namespace=namespace, uid=uid),
                reason=reason,
                message=message,
                type=type_,
            )
        )

    @_maybe_async
    def list_namespaced_event(self, namespace, field_selector=None, **_):
        wanted = dict(part.split("=", 1) for part in field_selector.split(",")) if field_selector else {}
        items = [
            e
            for e in self.events.get(namespace, [])
            if wanted.get("involvedObject.name", e.involved_object.name) == e.involved_object.name
        ]
        return client.CoreV1EventList(items=items)

    def read_namespaced_persistent_volume_claim(self, name, namespace, **_):
        """A claim of ``claims``: Bound, ReadWriteMany, to a volume that existed (no provisioner annotation),
        unless ``claim_details[(namespace, name)]`` says otherwise (phase, access_modes, provisioner, storage_class)."""
        if (namespace, name) not in self.claims:
            raise api_error(404, f'persistentvolumeclaims "{name}" not found')
        details = {"phase": "Bound", "access_modes": ["ReadWriteMany"], "provisioner": None, "storage_class": "",
                   **self.claim_details.get((namespace, name), {})}  # fmt: skip
        provisioner = details["provisioner"]
        annotations = {"volume.kubernetes.io/storage-provisioner": provisioner} if provisioner else None
        return client.V1PersistentVolumeClaim(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace, annotations=annotations),
            spec=client.V1PersistentVolumeClaimSpec(
                access_modes=details["access_modes"], storage_class_name=details["storage_class"]
            ),
            status=client.V1PersistentVolumeClaimStatus(phase=details["phase"]),
        )

    def read_namespaced_config_map(self, name, namespace, **_):
        data = self.config_maps.get((namespace, name))
        if data is None:
            raise api_error(404, f'configmaps "{name}" not found')
        return client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, namespace=namespace), data=dict(data))

    def read_namespaced_pod(self, name, namespace, **_):
        if self.before_read is not None:
            self.before_read()
        pod = next((p for p in self.pods.get(namespace, []) if p.metadata.name == name), None)
        if pod is None:
            raise api_error(404, f'pods "{name}" not found')
        return pod

    def remove_pod(self, namespace: str, name: str) -> None:
        self.pods[namespace] = [p for p in self.pods.get(namespace, []) if p.metadata.name != name]

    def add_pod(self, namespace: str, name: str, labels: dict, phase: str = "Running", log: str = "") -> None:
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace, labels=labels),
            status=client.V1PodStatus(phase=phase),
        )
        self.pods.setdefault(namespace, []).append(pod)
        self.logs[(namespace, name)] = log

    def set_phase(self, namespace: str, name: str, phase: str) -> None:
        for pod in self.pods.get(namespace, []):
            if pod.metadata.name == name:
                pod.status.phase = phase

    def append_log(self, namespace: str, name: str, text: str) -> None:
        self.logs[(namespace, name)] += text

    @_maybe_async
    def list_namespaced_pod(self, namespace, label_selector=None, **_):
        if self.before_read is not None:
            self.before_read()
        items = [p for p in self.pods.get(namespace, []) if _labels_match(p.metadata.labels, label_selector)]
        return client.V1PodList(items=items)

    def read_namespaced_pod_log(self, name, namespace, container=None, tail_lines=None, **_):
        self.log_reads.append({"name": name, "namespace": namespace, "container": container})
        pod = next((p for p in self.pods.get(namespace, []) if p.metadata.name == name), None)
        if pod is None:
            raise api_error(404, f'pods "{name}" not found')
        if pod.status.phase == "Pending":
            raise api_error(400, f'container "{container}" in pod "{name}" is waiting to start')
        text = self.logs[(namespace, name)]
        if isinstance(text, Path):
            text = text.read_text(errors="replace") if text.is_file() else ""
        if tail_lines is not None:
            text = "\n".join(text.splitlines()[-tail_lines:])
        return text


class FakeAuthorizationApi:
    """AuthorizationV1Api: SelfSubjectAccessReviews answered from ``allowed`` {(verb, resource, namespace)}."""

    def __init__(self, allowed=()):
        self.allowed = set(allowed)
        self.reviews: list[tuple[str, str, str]] = []

    def create_self_subject_access_review(self, body, **_):
        attributes = body.spec.resource_attributes
        asked = (attributes.verb, attributes.resource, attributes.namespace)
        self.reviews.append(asked)
        return client.V1SelfSubjectAccessReview(
            spec=body.spec, status=client.V1SubjectAccessReviewStatus(allowed=asked in self.allowed)
        )
