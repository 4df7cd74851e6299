"""The KServe deployment mode an InferenceService runs in, and what its redeploy may ask of it.

KServe runs a predictor in one of two modes: **Knative** (spelled ``Serverless`` up to v0.15; both from
v0.16), KServe's shipped default (``config/configmap/inferenceservice.yaml`` ``defaultDeploymentMode:
"Serverless"``, line 703 at v0.15.0, 745 at v0.20.0; the Helm chart's ``Knative``), and **Standard**
(spelled ``RawDeployment`` up to v0.15), a plain Kubernetes Deployment. The annotation
``serving.kserve.io/deploymentMode`` names it; the admission webhooks treat it so (kserve/kserve
``pkg/apis/serving/v1beta1``):

* The validating webhook sends every InferenceService whose annotation is not the raw spelling of its
  release to ``validateScalingKPACompExtension``, which refuses a predictor ``deploymentStrategy``
  ("customizing deploymentStrategy is only supported for raw deployment mode"):
  ``inference_service_validation.go`` ``validateAutoScalingCompExtension`` (199 at v0.15.0, 446 at
  v0.20.0) and the KPA check (395-397 at v0.15.0, 645-647 at v0.20.0). The raw spelling is
  ``RawDeployment`` up to v0.15.2 and ``Standard`` from v0.16.0; v0.16.0 does not rewrite an explicit
  ``RawDeployment`` (its validator refuses the strategy under it), v0.17.0 onwards rewrites it to
  ``Standard`` in the mutating webhook (``inference_service_defaults.go`` 160-169) before validation.
* The mutating webhook adds the annotation only when the cluster's default is raw (or ModelMesh)
  (``inference_service_defaults.go`` 156-167 at v0.15.0, 178-186 at v0.20.0), in the release's own spelling
  (v0.16+ normalise the ConfigMap's value first, ``configmap.go`` 357-369). No annotation = Knative.
* From v0.15.1 the controller records the mode in ``status.deploymentMode``, and an update whose
  annotation differs from it is refused ("deploymentMode cannot be changed": ``validateDeploymentMode``,
  447 at v0.15.1, 691 at v0.20.0; from v0.19.0 the status is normalised first).

So no one spelling is admitted with a ``deploymentStrategy`` by every release, and a first deploy cannot
know the cluster's default. The deploy step therefore creates the InferenceService without the annotation
(unless :class:`~llmft.components.lib.serving.inferenceservice.ServeSpec` names one) and without a
``deploymentStrategy`` (every release admits that, in either mode), and a redeploy
reads the mode the cluster gave the existing InferenceService (:func:`read_mode`: its status, else its
annotation, which the cluster's own webhook wrote in its own spelling): raw -> the same annotation plus
``deploymentStrategy: {type: Recreate}`` (the old pod goes first: no spare GPU), Knative -> neither (a new
Revision starts beside the serving one: one free GPU needed until it is Ready). tests/k8s/kserve_admission.py
plays these rules for each release and mode.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
RAW_MODES = ("Standard", "RawDeployment")
"""The raw (plain Deployment) mode: ``Standard`` from KServe v0.16, ``RawDeployment`` before."""
KNATIVE = "Knative"
STRATEGY_REFUSED = "customizing deploymentStrategy is only supported for raw deployment mode"
"""KServe's validating webhook's answer to a deploymentStrategy outside raw mode (v0.15.0-v0.20.0)."""
REDEPLOY_GUIDE = "docs/cluster-guide.md, Redeploying"


@dataclass(frozen=True)
class DeploymentMode:
    """An InferenceService's mode as the cluster spelled it on the object ("" = nothing names it: Knative)."""

    value: str
    source: str
    """Where it was read, for the step's log line."""

    @property
    def raw(self) -> bool:
        return self.value in RAW_MODES

    @property
    def name(self) -> str:
        return self.value or KNATIVE


def read_mode(obj: dict) -> DeploymentMode:
    """The mode of an InferenceService the cluster admitted: ``status.deploymentMode`` (v0.15.1+), else its
    annotation (v0.15.0 records no status mode), else Knative (the webhook annotates raw defaults only)."""
    status = (obj.get("status") or {}).get("deploymentMode")
    if status:
        return DeploymentMode(str(status), "its status.deploymentMode")
    annotation = ((obj.get("metadata") or {}).get("annotations") or {}).get(MODE_ANNOTATION)
    if annotation:
        return DeploymentMode(str(annotation), f"its {MODE_ANNOTATION} annotation, set by KServe's webhook")
    return DeploymentMode(
        "", f"no {MODE_ANNOTATION} on it: KServe's webhook adds one only when the cluster's default is raw"
    )


def redeploy_body(body: dict, existing: dict, rollout: str) -> tuple[dict, DeploymentMode]:
    """The replacement of ``existing`` (as the cluster holds it) by ``body``: the mode annotation the cluster
    recorded (so ``validateDeploymentMode`` sees no change), and in raw mode ``deploymentStrategy: {type:
    rollout}``. Returns (body, the mode)."""
    mode = read_mode(existing)
    out = without_strategy(body)
    annotations = out["metadata"].pop("annotations", None) or {}
    annotations.pop(MODE_ANNOTATION, None)
    if mode.value:  # the cluster's own value: an update may not change the mode, and without an annotation
        annotations[MODE_ANNOTATION] = mode.value  # the webhook would add the cluster's default, maybe another
    if mode.raw:
        out["spec"]["predictor"]["deploymentStrategy"] = {"type": rollout}
    if annotations:
        out["metadata"]["annotations"] = annotations
    return out, mode


def without_strategy(body: dict) -> dict:
    """``body`` without the predictor's deploymentStrategy: what every KServe release admits in either mode (a
    first deploy, whose mode the cluster decides; or a redeploy KServe refused it for: :data:`STRATEGY_REFUSED`)."""
    out = copy.deepcopy(body)
    out["spec"]["predictor"].pop("deploymentStrategy", None)
    return out


def mode_line(where: str, mode: DeploymentMode, *, redeploy: bool, rollout: str, gpus: int) -> str:
    """One line: which mode the InferenceService ``where`` (namespace/name) runs in, why, and what a redeploy needs."""
    verb = "replaced" if redeploy else "created"
    head = f"InferenceService {where} {verb} in {mode.name} mode ({mode.source})"
    if mode.raw and redeploy:
        return (
            f"{head}: deploymentStrategy {rollout}"
            + (
                ": the old pod goes first, so no spare GPU is needed; the model is down while the new pod loads"
                if rollout == "Recreate"
                else ": the new pod needs a free GPU before the old one goes"
            )  # fmt: skip
        )
    if mode.raw:
        return f"{head}: a redeploy replaces its pod (deploymentStrategy {rollout}) and needs no spare GPU"
    need = f"{gpus} free GPU{'s' if gpus != 1 else ''}" if gpus else "room for a second predictor pod"
    if redeploy:
        return (
            f"{head}: a new Revision starts beside the serving one, so this redeploy needs {need} until it is "
            f"Ready; the old Revision keeps serving meanwhile ({REDEPLOY_GUIDE})"
        )
    return (
        f"{head}: no deploymentStrategy (KServe refuses one outside raw mode); a later redeploy starts a new "
        f"Revision beside this one and needs {need} ({REDEPLOY_GUIDE})"
    )
