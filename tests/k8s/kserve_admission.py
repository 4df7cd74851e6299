"""KServe's admission webhooks and controller, per release, for what decides an InferenceService's deployment
mode: the ``serving.kserve.io/deploymentMode`` annotation, ``spec.predictor.deploymentStrategy`` and
``status.deploymentMode``. Each rule cites kserve/kserve at the tag it comes from (checked in the stored
source; paths under ``pkg/``):

* the cluster's default (``config/configmap/inferenceservice.yaml`` ``defaultDeploymentMode``:
  ``Serverless`` as shipped, line 703 at v0.15.0 and 745 at v0.20.0) is read by ``NewDeployConfig``
  (``apis/serving/v1beta1/configmap.go``), which from v0.16.0 maps ``Serverless`` to ``Knative`` and
  ``RawDeployment`` to ``Standard`` (357-369 at v0.16.0, 373-385 at v0.20.0);
* the mutating webhook (``apis/serving/v1beta1/inference_service_defaults.go`` ``DefaultInferenceService``,
  156-167 at v0.15.0, 157-167 at v0.16.0, 157-179 at v0.17.0, 163-185 at v0.20.0): from v0.17.0 it rewrites
  an annotation ``RawDeployment`` to ``Standard`` and ``Serverless`` to ``Knative``; without an annotation
  it adds the default when that is raw (``RawDeployment`` up to v0.15.2, ``Standard`` from v0.16.0) or
  ModelMesh;
* the validating webhook (``apis/serving/v1beta1/inference_service_validation.go``):
  ``validateAutoScalingCompExtension`` (199 at v0.15.0, 210 at v0.15.1, 253 at v0.16.0, 446 at v0.20.0)
  treats only the raw spelling of its release as raw (``RawDeployment`` up to v0.15.2, ``Standard`` from
  v0.16.0) and sends every other one to ``validateScalingKPACompExtension``, which refuses a
  ``deploymentStrategy`` (395-397 at v0.15.0, 645-647 at v0.20.0); on update ``validateDeploymentMode``
  refuses an annotation that differs from the old object's ``status.deploymentMode`` (from v0.15.1, 447;
  compared as stored up to v0.18.0, normalised with ``ParseDeploymentMode`` from v0.19.0, 586-595; skipped
  while the status is empty from v0.20.0, 691-700);
* the controller (``controller/v1beta1/inferenceservice/controller.go``, ``utils/utils.go``
  ``GetDeploymentMode``: 176 at v0.15.0, 221 at v0.16.0, 224 at v0.20.0) decides the mode from the status,
  else the annotation (v0.16.0 onwards mapping the legacy spellings), else the default, and records it in
  ``status.deploymentMode`` from v0.15.1 on (``controller.go`` 311 at v0.15.1, 425 at v0.20.0; v0.15.0 has
  no such field); from v0.19.0 a status value is normalised too.

Only these rules are played; the rest of KServe's validation (names, autoscaler classes, storage URIs) and
its reconcilers are not. v0.15.2 has v0.15.1's rules and v0.18.0 v0.17.0's; both are listed so every tag
the cluster guide names is walked. Not traced to source (test choice): the controller runs on every read of
the API and turns the InferenceService Ready at once, with a made-up URL.
"""

from __future__ import annotations

from dataclasses import dataclass

from k8s_fakes import api_error

ANNOTATION = "serving.kserve.io/deploymentMode"
VALIDATOR = 'admission webhook "inferenceservice.kserve-webhook-server.validator" denied the request: '
"""How the API server reports a validating webhook's refusal (the webhook's name: kserve v0.20.0
config/default/isvc_validatingwebhook_cainjection_patch.yaml 8)."""
KPA_REFUSAL = "customizing deploymentStrategy is only supported for raw deployment mode"
LEGACY = {"RawDeployment": "Standard", "Serverless": "Knative"}


@dataclass(frozen=True)
class Release:
    tag: str
    raw: str
    """The spelling the validator's switch treats as raw."""
    status_mode: bool
    """The controller records status.deploymentMode (v0.15.1+)."""
    new_names: bool
    """Knative/Standard exist; configmap and controller map the legacy names (v0.16.0+)."""
    mutate_normalises: bool
    """The mutating webhook rewrites legacy annotations (v0.17.0+)."""
    update_check: str
    """none (v0.15.0) | stored (v0.15.1-v0.18.0) | parsed (v0.19.0) | parsed-unless-empty (v0.20.0)."""


RELEASES = {
    r.tag: r
    for r in (
        Release("v0.15.0", "RawDeployment", False, False, False, "none"),
        Release("v0.15.1", "RawDeployment", True, False, False, "stored"),
        Release("v0.15.2", "RawDeployment", True, False, False, "stored"),
        Release("v0.16.0", "Standard", True, True, False, "stored"),
        Release("v0.17.0", "Standard", True, True, True, "stored"),
        Release("v0.18.0", "Standard", True, True, True, "stored"),
        Release("v0.19.0", "Standard", True, True, True, "parsed"),
        Release("v0.20.0", "Standard", True, True, True, "parsed-unless-empty"),
    )
}
DEFAULTS = {
    "v0.15": ("Serverless", "RawDeployment"),
    "v0.16+": ("Serverless", "Knative", "RawDeployment", "Standard"),
}
"""ConfigMap values of defaultDeploymentMode each release accepts (configmap.go 318-327 at v0.15.0, 357-374 at
v0.16.0): the shipped ``Serverless``, the Helm chart's ``Knative``, and the raw ones."""


def defaults_of(tag: str) -> tuple[str, ...]:
    return DEFAULTS["v0.15" if tag.startswith("v0.15") else "v0.16+"]


class KServe:
    """One cluster's KServe: ``release`` with ``default`` as the ConfigMap's defaultDeploymentMode."""

    def __init__(self, release: str, default: str):
        self.release = RELEASES[release]
        assert default in defaults_of(release), f"{release} refuses defaultDeploymentMode {default}"
        self.default = LEGACY.get(default, default) if self.release.new_names else default
        self.denied: list[str] = []
        self.ran: dict[tuple[str, int], tuple[str, str]] = {}
        """(name, generation) -> (mode, rollout) the controller reconciled it in: rollout is the Deployment's
        strategy in raw mode (RollingUpdate when none is given: deployment_reconciler.go 340-350 at v0.20.0),
        ``Revision`` in Knative mode (a new Revision beside the serving one)."""

    def install(self, custom) -> KServe:
        """Plug the webhooks and the controller into a FakeCustomObjectsApi."""
        self.install_webhooks(custom)
        custom.before_read = lambda: [
            self.reconcile(o) for k, o in custom.objects.items() if k[3] == "inferenceservices"
        ]
        return self

    def install_webhooks(self, custom) -> KServe:
        """Plug the webhooks alone (another simulator plays the controller: cluster_sim.py's FakeVllm)."""
        previous = custom.admission
        custom.admission = lambda op, plural, body, old: (
            self.admit(op, body, old) if plural == "inferenceservices" else (previous or _same)(op, plural, body, old)
        )
        return self

    # -- the webhooks ---------------------------------------------------------------------------------------
    def admit(self, op: str, body: dict, old: dict | None) -> dict:
        body = self.mutate(body)
        problem = self.validate(body, old if op == "UPDATE" else None)
        if problem:
            self.denied.append(problem)
            raise api_error(400, VALIDATOR + problem)
        return body

    def mutate(self, body: dict) -> dict:
        annotations = body["metadata"].setdefault("annotations", {})
        mode = annotations.get(ANNOTATION)
        if mode is not None and self.release.mutate_normalises:
            annotations[ANNOTATION] = LEGACY.get(mode, mode)
        if mode is None and self.default in (self.release.raw, "ModelMesh"):
            annotations[ANNOTATION] = self.default
        if not annotations:
            del body["metadata"]["annotations"]
        return body

    def validate(self, body: dict, old: dict | None) -> str:
        annotation = (body["metadata"].get("annotations") or {}).get(ANNOTATION)
        if old is not None:
            refused = self._mode_change(annotation, (old.get("status") or {}).get("deploymentMode") or "")
            if refused:
                return refused
        strategy = body["spec"]["predictor"].get("deploymentStrategy")
        if annotation != self.release.raw and strategy is not None:  # validateScalingKPACompExtension
            return KPA_REFUSAL
        return ""

    def _mode_change(self, annotation: str | None, status: str) -> str:
        check = self.release.update_check
        if check == "none" or not status or annotation is None:
            return ""
        if check != "stored":
            status = LEGACY.get(status, status)  # ParseDeploymentMode
        if annotation == status:
            return ""
        return f"update rejected: deploymentMode cannot be changed from '{status}' to '{annotation}'"

    # -- the controller -------------------------------------------------------------------------------------
    def mode_of(self, isvc: dict) -> str:
        """GetDeploymentMode: the status, else a known annotation, else the default."""
        status = (isvc.get("status") or {}).get("deploymentMode")
        if status:
            return LEGACY.get(status, status) if self.release.update_check.startswith("parsed") else status
        annotation = (isvc["metadata"].get("annotations") or {}).get(ANNOTATION)
        if annotation and self.release.new_names:
            annotation = LEGACY.get(annotation, annotation)
        known = ("Standard", "Knative", "ModelMesh") if self.release.new_names else tuple(RELEASES_V015_MODES)
        return annotation if annotation in known else self.default

    def reconcile(self, isvc: dict) -> None:
        status = isvc.setdefault("status", {})
        mode = self.mode_of(isvc)
        if self.release.status_mode:
            status["deploymentMode"] = mode
        name, namespace = isvc["metadata"]["name"], isvc["metadata"].get("namespace", "")
        status.update(
            url=f"http://{name}.{namespace}.example.com",
            conditions=[{"type": "Ready", "status": "True"}],
            observedGeneration=isvc["metadata"].get("generation", 1),
        )
        status["address"] = {"url": f"http://{name}-predictor.{namespace}.svc.cluster.local"}
        strategy = isvc["spec"]["predictor"].get("deploymentStrategy")
        rollout = (strategy or {}).get("type", "RollingUpdate") if mode in RAW else "Revision"
        self.ran[(name, isvc["metadata"].get("generation", 1))] = (mode, rollout)


RELEASES_V015_MODES = ("RawDeployment", "Serverless", "ModelMesh")
RAW = ("RawDeployment", "Standard")


def _same(_op, _plural, body, _old):
    return body
