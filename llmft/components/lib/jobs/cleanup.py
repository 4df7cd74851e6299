"""Cancelled or failed runs free their GPUs: the jobs a run started are found by its run-id label.

Three mechanisms, each for a way a run can end while a job still holds GPUs:

* **SIGTERM in the launcher** (:func:`delete_on_sigterm`), when the run was cancelled or timed out.
  Cancelling a run on KFP 2.4/2.5 patches the Argo Workflow's ``activeDeadlineSeconds`` to 0
  (kubeflow/pipelines 2.4.1 ``backend/src/common/util/execution_spec.go`` 315-322,
  ``resource_manager.go`` 797-813 TerminateWorkflow); Argo v3.4.17 (KFP 2.4.1's; 2.5.0 uses
  v3.5.14) then sends SIGTERM to the running task pods when ``spec.shutdown`` is set or the
  Workflow's deadline (``status.startedAt`` + ``activeDeadlineSeconds``, ``operator.go`` 574-584)
  has passed (``workflow/controller/exec_control.go`` 38-64), SIGKILL after the grace period
  (``controller.go`` 507-518). The signal reaches Python without an ``exec``: Argo execs ``kill``
  on PID 1, the emissary, which forwards every signal to the process group of the command it
  started with Setpgid (``cmd/argoexec/commands/emissary.go`` 147-155,
  ``workflow/executor/os-specific/command_unix.go`` 33, ``signal_darwin.go`` 19-25, linked as
  signal_linux.go); KFP's ``/kfp-launcher/launch`` runs the component's ``sh -ec`` with a plain
  ``exec.Command`` (``backend/src/v2/component/launcher_v2.go`` 410-415 at 2.4.1), so sh and
  python3 are in that group and get the SIGTERM directly. The launcher itself handles no signal
  and dies at once; the emissary notices within a second (``Wait``'s 1-s poll, signal_darwin.go
  46-59) and exits, which ends every process of the container: the handler must be quick.
  The same SIGTERM comes when the launcher pod is evicted (a node drain, spot preemption): there
  the job must live on, and the retried task re-attaches to it. :func:`sigterm_cause` tells the
  two apart from what the cluster shows (see there); only a cancel or a timeout deletes the job.
  The job's pods get SIGTERM in turn, so the trainer commits a checkpoint first.
* **The exit handler** (:func:`cleanup_run`, the ``cleanup-run`` task of both pipelines). When the
  body of the pipeline fails (a task failed after its retries, a launcher timed out, a launcher pod
  was lost), it deletes every job and Experiment labelled with the run id that has not finished.
  It never reads the run's final state (``dsl.PipelineTaskFinalStatus`` is "not supported yet" by
  the Argo compiler of KFP 2.4/2.5, ``backend/src/v2/compiler/argocompiler/dag.go`` 612-613 at 2.4.1): a finished
  job (Succeeded or Failed) holds no GPU and its pods keep their logs, so only unfinished ones go.
  After a cancel the hook may not run at all (kubeflow/pipelines#6101: "Step exceeded its
  deadline"); the SIGTERM handler covers that case.
* **ownerReferences** (:func:`run_owner_reference`). Jobs and Experiments are owned by the run's Argo
  Workflow (the owner of the launcher pod, ``workflow/controller/workflowpod.go`` 172-173), never by
  the launcher pod: a pod is deleted and replaced on every KFP retry and on eviction, which would
  delete the healthy job the retry should re-attach to. The Workflow lives across retries and is
  deleted with the run, or by KFP's persistence agent 7 days after the run ends
  (``backend/src/agent/persistence/main.go`` 163, ``worker/workflow_saver.go`` 64); the garbage
  collector then deletes the jobs too. Katib trials are owned by their Experiment already.

No real cluster runs in the tests: tests/k8s/cluster_sim.py plays the controllers these rely on.
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

from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.cluster import ClusterError, call_with_retries
from llmft.components.lib.plan.schema import KFP_POD_ENV, RUN_ID_LABEL, on_kfp_cluster, parse_time, run_label
from llmft.trainer.errors import EXIT_PREEMPTED

RUN_RESOURCES: tuple[tuple[str, str, str, str], ...] = (
    ("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"),
    ("kubeflow.org", "v1beta1", "experiments", "Experiment"),
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"),
)
"""(group, version, plural, kind) of everything a run may start; a kind whose CRD is not installed is skipped."""

FINISHED_CONDITIONS = ("Succeeded", "Failed", "Complete")
"""Condition types (status True) that mark a job or Experiment finished (TrainJob says Complete)."""


def run_selector(run_id: str) -> str:
    return f"{RUN_ID_LABEL}={run_label(run_id)}"


def is_finished(obj: Mapping[str, Any]) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") in FINISHED_CONDITIONS and c.get("status") == "True" for c in conditions)


def cleanup_run(
    cluster, run_id: str, *, print_fn: Callable[[str], Any] = print, lost_pods: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """Delete every unfinished job and Experiment labelled with ``run_id``, except those kept for the run's
    retry: one its evicted launcher marked (:data:`KEEP_ANNOTATION`), or any while the run's Workflow shows
    a launcher pod lost (``lost_pods``: :func:`lost_task_pods`). Returns what was deleted and kept, by
    kind. Raises ClusterError naming every object it could not delete (and the kubectl command to do it by
    hand) after trying them all."""

    selector = run_selector(run_id)
    report: dict[str, list[str]] = {"deleted": [], "kept": [], "kept_for_retry": []}
    problems: list[str] = []
    keep = functools.partial(_kept_for_retry, lost_pods=lost_pods)
    for resource in RUN_RESOURCES:
        problems += _cleanup_kind(cluster, resource, selector, report, print_fn, keep)
    if problems:
        kinds = ",".join(plural for _, _, plural, _ in RUN_RESOURCES)
        raise ClusterError(
            f"could not clean up run {run_id}: " + "; ".join(problems) + ". Delete them by hand: "
            f"kubectl delete -n {cluster.namespace} {kinds} -l {selector}"
        )
    if not report["deleted"]:
        print_fn(f"run {run_id}: no unfinished job or Experiment left (kept {len(report['kept'])} finished)")
    return report


def _kept_for_retry(obj: Mapping[str, Any], *, lost_pods: tuple[str, ...]) -> str:
    """Why the exit handler keeps this unfinished object for the run's retry ("" when it does not)."""
    marked = ((obj.get("metadata") or {}).get("annotations") or {}).get(KEEP_ANNOTATION)
    if marked:
        return marked
    return f"the run's Workflow lost pod(s) {', '.join(lost_pods)} (Argo: 'pod deleted')" if lost_pods else ""


def _cleanup_kind(
    cluster, resource: tuple[str, str, str, str], selector: str, report: dict, print_fn, keep
) -> list[str]:
    """Delete the unfinished objects of one kind matching ``selector`` that ``keep`` gives no reason to
    keep; returns the problems met."""

    group, version, plural, kind = resource
    try:
        items = call_with_retries(
            lambda: cluster.list_custom_objects(group, version, plural, label_selector=selector),
            what=f"list {plural}",
            print_fn=print_fn,
        )
    except ClusterError as exc:
        return [] if exc.status == 404 else [f"{kind}s: {exc}"]  # 404: this kind's CRD is not installed
    problems = []
    unfinished = [o for o in items if not is_finished(o)]
    for obj in unfinished:
        why = keep(obj)
        if why:
            name = obj["metadata"]["name"]
            report["kept_for_retry"].append(f"{kind}/{name}")
            print_fn(
                f"kept unfinished {kind} {cluster.namespace}/{name} for the run's retry ({why}): Retry the run (KFP UI "
                f"Retry, Client.retry_run) to re-attach to it, or delete it to free its GPUs: kubectl delete -n "
                f"{cluster.namespace} {plural} {name}"
            )
    for name in [o["metadata"]["name"] for o in unfinished if not keep(o)]:
        try:
            call_with_retries(
                functools.partial(cluster.delete_custom_object, group, version, plural, name),
                what=f"delete {kind} {name}",
                print_fn=print_fn,
            )
        except ClusterError as exc:
            if exc.status != 404:  # already gone is fine
                problems.append(f"{kind}/{name}: {exc}")
                continue
        report["deleted"].append(f"{kind}/{name}")
        print_fn(f"deleted unfinished {kind} {cluster.namespace}/{name}")
    report["kept"] += [f"{kind}/{o['metadata']['name']}" for o in items if is_finished(o)]
    return problems


def cleanup_after_run(run_id: str, *, environ: Mapping[str, str] | None = None, cluster=None) -> dict:
    """The ``cleanup-run`` exit task's body: clean up on a cluster; under kfp.local nothing was
    started outside the run's own processes (local backends), so nothing is left to delete."""

    if not on_kfp_cluster(environ) and cluster is None:
        print(f"kfp.local run {run_id}: no cluster jobs to clean up")
        return {"deleted": [], "kept": [], "skipped": True}

    cluster = cluster or cluster_module.Cluster()
    return cleanup_run(cluster, run_id, lost_pods=lost_task_pods(cluster, environ=environ))


LOST_POD_MESSAGE = "pod deleted"
"""The message Argo gives a Pod node whose pod vanished before it recorded the pod's phase (a node drain,
a lost node): argo-workflows workflow/controller/operator.go 1175 at v3.4.17, 1289 at v4.0.5. The node is
an Error, which KFP's retryStrategy (no retryPolicy: OnFailure, operator.go 1035-1042) does not retry."""


def lost_task_pods(cluster, *, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Pod nodes of this run's Workflow (the exit-handler pod's owner) that Argo marked Error 'pod deleted';
    () when none or when the Workflow cannot be read."""
    launcher = read_launcher_pod(cluster, environ=environ, print_fn=_quiet)
    if launcher.workflow is None:
        return ()
    try:
        workflow = cluster.get_custom_object(*WORKFLOW, launcher.workflow.name)
    except ClusterError:
        return ()
    nodes = ((workflow.get("status") or {}).get("nodes") or {}).values()
    lost = [n for n in nodes if n.get("type") == "Pod" and n.get("phase") == "Error"]
    return tuple(n.get("displayName") or n.get("name", "") for n in lost if n.get("message") == LOST_POD_MESSAGE)


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
DELETE_CAUSES = ("cancelled", "timed out", "unknown")
"""Causes of a launcher's SIGTERM that delete its job (:func:`sigterm_cause`)."""


KEEP_ANNOTATION = "llmft.kubeflow.org/keep-for-retry"
"""Set on a job by its launcher's SIGTERM handler when the launcher was evicted (the value says how):
the exit handler (:func:`cleanup_run`) keeps such a job for the run's retry to re-attach to."""


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
    * ``other``: the Workflow is neither and the pod shows no disruption (deleted by hand, say): kept;
    * ``unknown``: outside a KFP pod, or the pod or Workflow cannot be read (RBAC): deleted, as a
      cancel is the usual reason and a job left behind would hold its GPUs until its deadline.

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
    """While the block runs, SIGTERM deletes the named object if the run was cancelled or timed out
    (``cause``, default :func:`sigterm_cause` on ``launcher``, read on entry when None), keeps it
    otherwise, and exits 143 (preempted). An evicted launcher also marks the object
    (:data:`KEEP_ANNOTATION`) so that the exit handler keeps it for the run's retry.

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
            print_fn(f"SIGTERM ({kind}: {why}): keeping {plural} {name}; the task's retry re-attaches to it")
            if kind == "evicted":
                _mark_kept(cluster, target, namespace, f"launcher evicted: {why}", print_fn)
            raise SystemExit(EXIT_PREEMPTED)
        print_fn(f"SIGTERM ({kind}: {why}): deleting {plural} {name}")
        try:
            cluster.delete_custom_object(*target, namespace=namespace)
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
        print_fn(f"warning: could not mark {target[2]} {target[3]} to be kept: {exc}")


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
