"""The launcher pod's side of a run's cleanup: what it reads of itself, and its SIGTERM handler.

Split from llmft/components/lib/jobs/cleanup.py, whose docstring explains the three mechanisms (SIGTERM
in the launcher, the exit handler, ownerReferences); this module holds the first and third:
:func:`delete_on_sigterm` (a cancel or timeout deletes the job, an eviction keeps it for the retry:
:func:`sigterm_cause`), :func:`read_launcher_pod` and :func:`run_owner_reference`. The training backends
(llmft/components/lib/jobs/backends.py) and the sweep step import it; the exit handler reads the
registry of backends, so the two halves live apart.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from llmft.components.lib.cluster import ClusterError
from llmft.components.lib.contracts.run_jobs import KFP_POD_ENV, parse_time
from llmft.trainer.errors import EXIT_PREEMPTED


def unmark_kept(cluster, target: tuple[str, str, str, str], obj: Mapping[str, Any], namespace: str | None) -> None:
    """A retried launcher re-attached to ``obj``: drop its keep mark, so a later failure cleans it up again."""
    if KEEP_ANNOTATION in ((obj.get("metadata") or {}).get("annotations") or {}):
        cluster.patch_custom_object(
            *target, {"metadata": {"annotations": {KEEP_ANNOTATION: None}}}, namespace=namespace
        )


DISRUPTION_CONDITION = "DisruptionTarget"
"""The pod condition Kubernetes adds before it deletes a pod for a disruption (k8s.io/api
``core/v1/types.go`` DisruptionTarget; reasons EvictionByEvictionAPI for ``kubectl drain`` and other
Eviction API calls, PreemptionByScheduler, DeletionByTaintManager, TerminationByKubelet for
node-pressure eviction and graceful node shutdown, DeletionByPodGC; on by default since 1.26, GA
in 1.31: https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions)."""
WORKFLOW = ("argoproj.io", "v1alpha1", "workflows")
"""(group, version, plural) of the run's Argo Workflow, which the launcher reads on SIGTERM."""
DELETE_CAUSES = ("cancelled", "timed out")
"""Causes of a launcher's SIGTERM that delete its job (:func:`sigterm_cause`): what the run's Workflow shows.
Every other cause keeps the job, marked for the run's retry: an eviction whose ``DisruptionTarget`` the kubelet
has not written yet reads as ``other``, a Workflow that did not answer as ``unknown``. A cancel the handler
could not see is deleted by the run's janitor once the Workflow shows the run ended
(llmft/components/lib/jobs/orphans.py)."""


KEEP_ANNOTATION = "llmft.kubeflow.org/keep-for-retry"
"""Set on a job by its launcher's SIGTERM handler when the run was not shown cancelled or timed out (the value
says why: an eviction, or a cause it could not read): the exit handler (:func:`cleanup_run`) and the janitor
keep such a job for the run's retry to re-attach to (the janitor for ``keep_for_retry_s`` after the run ended)."""


@dataclass(frozen=True)
class LauncherPod:
    """This launcher pod as read once before training starts (:func:`read_launcher_pod`), so that its
    SIGTERM handler needs one GET of the Workflow before it deletes the job (the emissary gives it
    about a second: module docstring)."""

    name: str = ""  # KFP_POD_NAME; "" outside a KFP task pod
    workflow: Any = None  # the pod's controller ownerReference of kind Workflow, or None
    deadline_s: int | None = None  # the pod's activeDeadlineSeconds (a task timeout)
    started: float | None = None  # the pod's status.startTime, seconds since the epoch
    problem: str = ""  # why it could not be read

    def owner_reference(self) -> dict | None:
        """The ownerReference the jobs this launcher creates get: the run's Workflow (cleanup.py docstring)."""
        owner = self.workflow
        if owner is None:
            return None
        keys = {"apiVersion": owner.api_version, "kind": owner.kind, "name": owner.name, "uid": owner.uid}
        return {**keys, "blockOwnerDeletion": False}


def read_launcher_pod(
    cluster, *, environ: Mapping[str, str] | None = None, print_fn: Callable[[str], Any] = print
) -> LauncherPod:
    """One GET of this pod (KFP_POD_NAME): its Workflow owner, its task deadline and start."""

    pod_name = (os.environ if environ is None else environ).get(KFP_POD_ENV, "")
    if not pod_name:
        return LauncherPod(problem="not in a KFP task pod")
    try:
        pod = cluster.read_pod(pod_name)
    except ClusterError as exc:
        print_fn(f"note: jobs get no owner (cannot read this pod {pod_name}: {exc})")
        return LauncherPod(pod_name, problem=f"cannot read this pod {pod_name}: {exc}")
    status = pod.status
    started = status.start_time.timestamp() if status is not None and status.start_time else None
    deadline = pod.spec.active_deadline_seconds if pod.spec else None
    return LauncherPod(pod_name, _workflow_owner(pod), deadline, started)


def sigterm_cause(
    cluster,
    launcher: LauncherPod | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    now: float | None = None,
) -> tuple[str, str]:
    """Why this launcher pod got SIGTERM: (cause, what shows it), cause one of

    * ``timed out``: the pod's own ``activeDeadlineSeconds`` (a task timeout, KFP driver.go 703-705)
      or the Workflow's has passed;
    * ``cancelled``: the Workflow's ``spec.shutdown`` is set, or its ``activeDeadlineSeconds`` is 0
      (what KFP's cancel patches);
    * ``evicted``: the Workflow is neither, and the pod carries ``DisruptionTarget`` True (drain,
      preemption, taint, node pressure or shutdown): the job lives on, the retry re-attaches to it;
    * ``other``: the Workflow is neither and the pod shows no disruption yet (a kubelet eviction writes its
      condition asynchronously; deleted by hand): kept, and marked;
    * ``unknown``: outside a KFP pod, or the pod or Workflow cannot be read (RBAC, an API that did not
      answer): kept, and marked; if it was a cancel, the janitor deletes the job once the run has ended.

    ``launcher``: this pod as read before training (:func:`read_launcher_pod`; read now when None).
    The order makes a cancel's DELETE quick: the task deadline needs no call, the Workflow one GET;
    only a Workflow that is not stopping costs a second GET (of the pod, for its disruption).
    """
    now = time.time() if now is None else now
    launcher = launcher if launcher is not None else read_launcher_pod(cluster, environ=environ, print_fn=_quiet)
    if not launcher.name or launcher.problem:
        return "unknown", launcher.problem or "not in a KFP task pod"
    if (
        launcher.deadline_s is not None
        and launcher.started is not None
        and now >= launcher.started + launcher.deadline_s
    ):
        return (
            "timed out",
            f"pod {launcher.name} passed its activeDeadlineSeconds {launcher.deadline_s} (the task's timeout)",
        )
    if launcher.workflow is None:
        return "unknown", f"pod {launcher.name} has no Workflow owner"
    try:
        workflow = cluster.get_custom_object(*WORKFLOW, launcher.workflow.name)
    except ClusterError as exc:
        return "unknown", f"cannot read Workflow {launcher.workflow.name}: {exc}"
    cause = _workflow_cause(workflow, now)
    return cause if cause[0] != "other" else _disruption(cluster, launcher.name, cause)


def _disruption(cluster, pod_name: str, otherwise: tuple[str, str]) -> tuple[str, str]:
    """("evicted", why) when the pod carries DisruptionTarget True, else ``otherwise``."""
    try:
        pod = cluster.read_pod(pod_name)
    except ClusterError as exc:
        return "other", f"{otherwise[1]}; cannot read this pod {pod_name}: {exc}"
    conditions = (pod.status.conditions if pod.status else None) or []
    disrupted = next((c for c in conditions if c.type == DISRUPTION_CONDITION and c.status == "True"), None)
    if disrupted is None:
        return otherwise
    return "evicted", f"pod {pod_name} has {DISRUPTION_CONDITION} {disrupted.reason}: {disrupted.message or ''}"


def _quiet(_line: str) -> None:
    return None


def _workflow_cause(workflow: Mapping[str, Any], now: float) -> tuple[str, str]:
    """Argo's own test (exec_control.go 38-64, operator.go 574-584) of whether it stops this pod."""

    name, spec = workflow["metadata"]["name"], workflow.get("spec") or {}
    if spec.get("shutdown"):
        return "cancelled", f"Workflow {name} has spec.shutdown {spec['shutdown']}"
    deadline = spec.get("activeDeadlineSeconds")
    started = parse_time((workflow.get("status") or {}).get("startedAt"))
    if deadline is not None and int(deadline) == 0:
        return "cancelled", f"Workflow {name} has activeDeadlineSeconds 0 (the run was cancelled)"
    if deadline is not None and started is not None and now >= int(started) + int(deadline):
        return "timed out", f"Workflow {name} passed its activeDeadlineSeconds {deadline}"
    return "other", f"Workflow {name} is neither cancelled nor past its deadline"


@contextlib.contextmanager
def delete_on_sigterm(
    cluster,
    group: str,
    version: str,
    plural: str,
    name: str,
    *,
    namespace: str | None = None,
    print_fn: Callable[[str], Any] = print,
    cause: Callable[[], tuple[str, str]] | None = None,
    launcher: LauncherPod | None = None,
) -> Iterator[None]:
    """While the block runs, SIGTERM deletes the named object (foreground: it goes once its pods have
    committed their checkpoint) if the run was cancelled or timed out (``cause``, default
    :func:`sigterm_cause` on ``launcher``, read on entry when None), keeps it otherwise, marked
    (:data:`KEEP_ANNOTATION`) for the run's retry, and exits 143 (preempted).

    Only the main thread can receive signals; elsewhere (a test runner's thread) this is a no-op.
    The previous handler is restored when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if cause is None:
        launcher = launcher if launcher is not None else read_launcher_pod(cluster, print_fn=_quiet)
        cause = functools.partial(sigterm_cause, cluster, launcher)
    target = (group, version, plural, name)

    def on_sigterm(signum, _frame):
        try:
            kind, why = cause()
        except Exception as exc:  # noqa: BLE001 - deciding must not stop the cleanup
            kind, why = "unknown", f"could not tell why: {exc}"
        if kind not in DELETE_CAUSES:
            print_fn(
                f"SIGTERM ({kind}: {why}): keeping {plural} {name}; the task's retry re-attaches to it (the run's "
                "janitor deletes it once the run has ended)"
            )
            _mark_kept(cluster, target, namespace, f"launcher {kind}: {why}", print_fn)
            raise SystemExit(EXIT_PREEMPTED)
        print_fn(f"SIGTERM ({kind}: {why}): deleting {plural} {name}")
        try:
            cluster.delete_custom_object(*target, namespace=namespace, propagation="Foreground")
        except Exception as exc:  # noqa: BLE001 - report and exit anyway: the exit handler tries again
            print_fn(f"warning: could not delete {plural} {name}: {exc}")
        raise SystemExit(EXIT_PREEMPTED)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _mark_kept(cluster, target: tuple[str, str, str, str], namespace: str | None, why: str, print_fn) -> None:
    """Record on the object that the exit handler must keep it (:data:`KEEP_ANNOTATION`)."""
    patch = {"metadata": {"annotations": {KEEP_ANNOTATION: why[:500]}}}
    try:
        cluster.patch_custom_object(*target, patch, namespace=namespace)
    except Exception as exc:  # noqa: BLE001 - the exit handler also reads the Workflow's lost pods
        print_fn(f"warning: could not mark {target[2]} {target[3]} to be kept: {exc}")  # the exit handler and the
        # janitor also read the run's lost and evicted pods (cleanup.py lost_task_pods)


def _workflow_owner(pod) -> Any:
    """The pod's controller owner of kind Workflow (Argo, workflowpod.go 172-173), or None."""
    owners = (pod.metadata.owner_references or []) if pod is not None and pod.metadata else []
    return next((o for o in owners if o.kind == "Workflow" and o.controller), None)


def run_owner_reference(
    cluster, *, environ: Mapping[str, str] | None = None, print_fn: Callable[[str], Any] = print
) -> dict | None:
    """The ownerReference to put on the jobs this launcher creates: the run's Argo Workflow (the
    controller owner of this pod, whose name KFP sets in KFP_POD_NAME). None outside a KFP pod or
    when the pod cannot be read; ``blockOwnerDeletion`` stays false (setting it needs RBAC on
    workflows' finalizers)."""

    return read_launcher_pod(cluster, environ=environ, print_fn=print_fn).owner_reference()
