"""Apply an InferenceService to the cluster and wait until it serves (the deploy step's ``kserve`` mode).

:func:`deploy_inference_service` creates the InferenceService, or replaces the one of that name, in the
mode the cluster gives it (llmft/components/lib/serving/deployment_mode.py: a first deploy carries no
``deploymentStrategy``, which KServe refuses outside raw mode; a redeploy keeps the cluster's mode and, in
raw mode, asks for the rollout), prints one line saying which mode and why, and waits for Ready: the
condition, ``status.url`` and a status of the current generation. While it waits it says why the predictor's
pods are Pending (a Knative redeploy's new Revision without a free GPU, say); a failed model load ends the
wait at once, naming the claim the model is read from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llmft.components.lib.cluster import Cluster, ClusterError
from llmft.components.lib.jobs.pending_pods import PendingReporter
from llmft.components.lib.serving.deployment_mode import (
    STRATEGY_REFUSED,
    DeploymentMode,
    mode_line,
    read_mode,
    redeploy_body,
    without_strategy,
)
from llmft.components.lib.serving.inferenceservice import GROUP, PLURAL, VERSION, isvc_to_dict

PREDICTOR_LABEL = "serving.kserve.io/inferenceservice"
"""The label KServe puts on an InferenceService's pods (kserve v0.20.0 pkg/constants/constants.go 61)."""
SERVING_PENDING_EVERY = 6
"""Polls between two reports of why the predictor's pods are Pending (10-s polls: every minute; a serving wait is
minutes, so it reports more often than the job wait (lib/jobs/lifecycle.py PENDING_EVERY: every 5 minutes)."""
SERVING_HINTS = (
    (
        "Insufficient nvidia.com/gpu",
        "no node has a free GPU for the predictor: a Knative redeploy starts its new Revision beside the serving "
        "one (docs/cluster-guide.md, Redeploying); free a GPU, or lower serving_gpus",
    ),
    ("untolerated taint", "the nodes with room are tainted: check gpu_node_selector"),
    ("didn't match Pod's node affinity/selector", "no node matches gpu_node_selector: check its labels"),
    ("persistentvolumeclaim", "the model's PVC is missing or not bound in the serving namespace"),
)


def isvc_ready(obj: dict) -> tuple[bool, str]:
    """(ready, why not): Ready means condition Ready=True, status.url set, and the status
    observed the current generation."""
    status = obj.get("status") or {}
    generation = (obj.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if generation is not None and observed is not None and observed < generation:
        return False, f"status is from generation {observed}, spec is generation {generation}"
    if not ready or ready.get("status") != "True":
        reason = (ready or {}).get("reason") or (ready or {}).get("message") or "no Ready condition yet"
        return False, f"Ready is not True ({reason})"
    if not status.get("url"):
        return False, "status.url not set yet"
    return True, ""


def _load_failure(obj: dict) -> str | None:
    model_status = (obj.get("status") or {}).get("modelStatus") or {}
    if model_status.get("transitionStatus") in ("BlockedByFailedLoad", "InvalidSpec"):
        info = model_status.get("lastFailureInfo") or {}
        return f"{model_status['transitionStatus']}: {info.get('reason', '')} {info.get('message', '')}".strip()
    return None


def _gpus(body: dict) -> int:
    model = ((body.get("spec") or {}).get("predictor") or {}).get("model") or {}
    return int(((model.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0) or 0)


def load_failure_message(body: dict, failure: str, pipeline_namespace: str) -> str:
    """One line: the InferenceService, the failure, the claim the model is read from, and the likely cause
    when it serves in another namespace than the pipeline's (a claim of the same name there is another
    volume unless it is bound to the same one: docs/cluster-guide.md, Serving in another namespace)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    uri = str((((body.get("spec") or {}).get("predictor") or {}).get("model") or {}).get("storageUri") or "")
    claim = uri.removeprefix("pvc://").split("/", 1)[0] if uri.startswith("pvc://") else ""
    source = f" It reads {uri} (PVC {namespace}/{claim})." if claim else f" It reads {uri}." if uri else ""
    cause = ""
    if claim and namespace != pipeline_namespace:
        cause = (
            f" Likely cause: it serves in namespace {namespace}, not the pipeline's {pipeline_namespace}, and PVC "
            f"{namespace}/{claim} is not bound to the volume the pipeline wrote (a claim a StorageClass provisioned "
            "there is a new, empty volume: docs/cluster-guide.md, Serving in another namespace)."
        )
    return (
        f"InferenceService {namespace}/{name} failed to load the model: {failure}.{source}{cause} Check the "
        f"predictor pod's log (kubectl logs -n {namespace} -l {PREDICTOR_LABEL}={name} -c kserve-container)"
    )


def apply_inference_service(
    cluster: Cluster, body: dict, namespace: str, *, rollout: str = "Recreate", print_fn: Callable[[str], Any] = print
) -> tuple[dict, DeploymentMode, bool]:
    """Create the InferenceService, or replace the one there in the mode the cluster gave it; prints which
    mode and why. Returns (the applied object, its mode, whether it replaced one)."""
    name = body["metadata"]["name"]
    where, gpus = f"{namespace}/{name}", _gpus(body)
    try:
        created = cluster.create_custom_object(GROUP, VERSION, PLURAL, without_strategy(body), namespace=namespace)
    except ClusterError as exc:
        if exc.status != 409:
            raise
    else:
        mode = read_mode(created)
        print_fn(mode_line(where, mode, redeploy=False, rollout=rollout, gpus=gpus))
        return created, mode, False
    existing = cluster.get_custom_object(GROUP, VERSION, PLURAL, name, namespace=namespace)
    replacement, mode = redeploy_body(body, existing, rollout)
    replacement["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
    try:
        applied = cluster.replace_custom_object(GROUP, VERSION, PLURAL, name, replacement, namespace=namespace)
    except ClusterError as exc:
        if exc.status != 400 or STRATEGY_REFUSED not in str(exc):
            raise
        print_fn(
            f"warning: KServe refused deploymentStrategy {rollout} on InferenceService {where} although "
            f"{mode.source} says {mode.value} ({exc}); replaced without it: KServe's default RollingUpdate, so the "
            f"new pod needs {gpus or 'no'} free GPU(s) before the old one goes"
        )
        applied = cluster.replace_custom_object(
            GROUP, VERSION, PLURAL, name, without_strategy(replacement), namespace=namespace
        )
        return applied, mode, True
    print_fn(mode_line(where, mode, redeploy=True, rollout=rollout, gpus=gpus))
    return applied, mode, True


def deploy_inference_service(
    cluster: Cluster,
    isvc,
    *,
    timeout_s: float = 1800.0,
    poll_s: float = 10.0,
    print_fn: Callable[[str], Any] = print,
    rollout: str = "Recreate",
    pending_every: int = SERVING_PENDING_EVERY,
) -> dict:
    """Create (or replace) the InferenceService and wait until it is Ready; returns
    ``{"name", "namespace", "url", "internal_url", "generation", "deployment_mode"}``. A failed model load
    raises RuntimeError at once; no Ready within ``timeout_s`` raises TimeoutError (with why its pods are
    Pending, and what a Knative redeploy needs)."""
    body = isvc if isinstance(isvc, dict) else isvc_to_dict(isvc)
    name = body["metadata"]["name"]
    namespace = body["metadata"].get("namespace") or cluster.namespace
    body["metadata"]["namespace"] = namespace
    applied, mode, replaced = apply_inference_service(cluster, body, namespace, rollout=rollout, print_fn=print_fn)
    generation = (applied.get("metadata") or {}).get("generation")
    print_fn(f"applied InferenceService {namespace}/{name} (generation {generation}); waiting for Ready")
    pending = PendingReporter(
        cluster, f"{PREDICTOR_LABEL}={name}", namespace, every=pending_every, print_fn=print_fn, hints=SERVING_HINTS
    )
    deadline, why = time.monotonic() + timeout_s, "not polled yet"
    stuck: list[str] = []
    while True:
        obj = cluster.get_custom_object(GROUP, VERSION, PLURAL, name, namespace=namespace)
        if generation is not None:
            obj.setdefault("metadata", {}).setdefault("generation", generation)
        failure = _load_failure(obj)
        if failure:
            raise RuntimeError(load_failure_message(body, failure, cluster.namespace))
        ready, why = isvc_ready(obj)
        if ready:
            status = obj["status"]
            return {
                "name": name,
                "namespace": namespace,
                "url": status["url"],
                "internal_url": (status.get("address") or {}).get("url"),
                "generation": generation,
                "deployment_mode": mode.name,
            }
        if time.monotonic() + poll_s > deadline:
            raise TimeoutError(_timeout_message(f"{namespace}/{name}", timeout_s, why, stuck, mode, replaced))
        stuck = pending() or stuck
        time.sleep(poll_s)


def _timeout_message(where: str, timeout_s: float, why: str, stuck: list[str], mode, replaced: bool) -> str:
    pods = f"; {'; '.join(stuck)}" if stuck else ""
    knative = (
        f". In {mode.name} mode a redeploy's new Revision needs its own GPU beside the serving Revision, which "
        "keeps serving: free one, or delete the InferenceService before redeploying (docs/cluster-guide.md, "
        "Redeploying)"
        if replaced and not mode.raw
        else ""
    )
    return f"InferenceService {where} not Ready after {timeout_s:.0f}s: {why}{pods}{knative}"
