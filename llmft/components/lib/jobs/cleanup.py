"""Cancelled or failed runs free their GPUs: the jobs a run started are found by its run-id label.

Four mechanisms, each for a way a run can end while a job still holds GPUs:

* **SIGTERM in the launcher** (:func:`~llmft.components.lib.jobs.launcher_pod.delete_on_sigterm`), when the run
  was cancelled or timed out: the fast path.
  Cancelling a run on KFP 2.4-2.17 patches the Argo Workflow's ``activeDeadlineSeconds`` to 0
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
  and dies at once; the emissary notices at its next 1-s poll (``Wait``'s poll, signal_darwin.go
  46-59), uniformly 0-1 s after the signal, and exits, which ends every process of the container:
  the handler's DELETE lands only when its API calls beat that tick. The janitor (below) does not
  depend on it. The same SIGTERM comes when the launcher pod is evicted (a node drain, spot preemption,
  node pressure): there the job must live on, and the retried task re-attaches to it. :func:`sigterm_cause`
  tells the two apart from what the cluster shows (llmft/components/lib/jobs/launcher_pod.py); only a
  cancel or a timeout shown by the Workflow deletes the job, anything else marks it kept for the retry.
  The job's pods get SIGTERM in turn, so the trainer commits a checkpoint first.
* **The exit handler** (:func:`cleanup_run`, the ``cleanup-run`` task of both pipelines). When the
  body of the pipeline fails (a task failed after its retries, a launcher timed out, a launcher pod
  was lost), it deletes every job and Experiment labelled with the run id that has not finished and
  is not kept for the run's retry (:func:`keep_reason`).
  It never reads the run's final state (``dsl.PipelineTaskFinalStatus`` is "not supported yet" by
  the Argo compiler of KFP 2.4/2.5, ``backend/src/v2/compiler/argocompiler/dag.go`` 612-613 at 2.4.1): a finished
  job (Succeeded or Failed) holds no GPU and its pods keep their logs, so only unfinished ones go.
  It runs once per run: not after a cancel (kubeflow/pipelines#6101), and not again after a run's Retry
  (a hook that succeeded is carried forward: llmft/components/lib/jobs/orphans.py).
* **The janitor** (llmft/components/lib/jobs/orphans.py, ``llmft pipeline janitor``, a CronJob of
  deploy/): every 2 minutes it deletes the unfinished jobs and Experiments whose run's Workflow has
  finished (those kept for a Retry once ``keep_for_retry_s`` has passed), whatever ended the run and
  whichever of the two above ran. It is what makes "no job outlives its run" hold.
* **ownerReferences** (:func:`~llmft.components.lib.jobs.launcher_pod.run_owner_reference`). Jobs and
  Experiments are owned by the run's Argo
  Workflow (the owner of the launcher pod, ``workflow/controller/workflowpod.go`` 172-173), never by
  the launcher pod: a pod is deleted and replaced on every KFP retry and on eviction, which would
  delete the healthy job the retry should re-attach to. The Workflow lives across retries and is
  deleted with the run, or by KFP's persistence agent 7 days after the run ends
  (``backend/src/agent/persistence/main.go`` 163, ``worker/workflow_saver.go`` 64); the garbage
  collector then deletes the jobs too. Katib trials are owned by their Experiment already.

Every delete uses foreground propagation: the job stays (``deletionTimestamp`` set) until its pods are gone,
so a launcher that creates the job again under the same name (a quick Retry after a cancel) waits for the
old pods to finish their SIGTERM checkpoint instead of starting beside them.

No real cluster runs in the tests: tests/k8s/cluster_sim.py plays the controllers these rely on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.cluster import ClusterError, call_with_retries
from llmft.components.lib.contracts.run_jobs import RUN_ID_LABEL, on_kfp_cluster, run_label
from llmft.components.lib.jobs.backends import run_resources
from llmft.components.lib.jobs.launcher_pod import DISRUPTION_CONDITION, KEEP_ANNOTATION, WORKFLOW, read_launcher_pod

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
    retry: one its launcher marked (:data:`KEEP_ANNOTATION`), or any while the run's Workflow shows a task
    pod lost or stopped by a disruption (``lost_pods``: :func:`lost_task_pods`). Returns what was deleted and kept, by
    kind. Raises ClusterError naming every object it could not delete (and the kubectl command to do it by
    hand) after trying them all."""

    selector = run_selector(run_id)
    report: dict[str, list[str]] = {"deleted": [], "kept": [], "kept_for_retry": []}
    problems: list[str] = []
    keep = functools.partial(keep_reason, lost_pods=lost_pods)
    resources = run_resources()  # every backend's kind and Katib's Experiment; one whose CRD is absent is skipped
    for resource in resources:
        problems += _cleanup_kind(cluster, resource, selector, report, print_fn, keep)
    if problems:
        kinds = ",".join(plural for _, _, plural, _ in resources)
        raise ClusterError(
            f"could not clean up run {run_id}: " + "; ".join(problems) + ". Delete them by hand: "
            f"kubectl delete -n {cluster.namespace} {kinds} -l {selector}"
        )
    if not report["deleted"]:
        print_fn(f"run {run_id}: no unfinished job or Experiment left (kept {len(report['kept'])} finished)")
    return report


def keep_reason(obj: Mapping[str, Any], *, lost_pods: tuple[str, ...]) -> str:
    """Why this unfinished object is kept for the run's retry ("" when it is not): its launcher marked it
    (:data:`KEEP_ANNOTATION`), or the run's Workflow shows a launcher pod lost (``lost_pods``)."""
    marked = ((obj.get("metadata") or {}).get("annotations") or {}).get(KEEP_ANNOTATION)
    if marked:
        return marked
    return f"the run's task pod(s) {', '.join(lost_pods)} were lost or evicted" if lost_pods else ""


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
                functools.partial(cluster.delete_custom_object, group, version, plural, name, propagation="Foreground"),
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
WORKFLOW_POD_LABEL = "workflows.argoproj.io/workflow"
"""The label Argo puts on every pod of a Workflow (argo-workflows v3.4.17 workflow/common/common.go 75-76)."""
KUBELET_STOPS = ("Evicted", "Terminated")
"""``status.reason`` of a pod the kubelet stopped without deleting it: a node-pressure eviction (``Evicted``)
and a graceful node shutdown (``Terminated``, "Pod was terminated in response to imminent node shutdown.":
kubernetes pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go 43-44 at 1dd781d). The pod stays in the API
Failed, so Argo sees Failed (and retries) where a drain gives Error 'pod deleted'; the kubelet's
``DisruptionTarget`` condition (TerminationByKubelet) may reach the API after the launcher's SIGTERM handler
read its pod, so the exit handler and the janitor read it again, from the pods themselves."""


def lost_task_pods(cluster, *, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """What shows a task pod of this run (the exit-handler pod's Workflow) stopped under it: pod nodes Argo
    marked Error 'pod deleted', and pods a disruption or the kubelet stopped (:func:`disrupted_pods`); ()
    when none or when the Workflow cannot be read."""
    launcher = read_launcher_pod(cluster, environ=environ, print_fn=lambda _line: None)
    if launcher.workflow is None:
        return ()
    try:
        workflow = cluster.get_custom_object(*WORKFLOW, launcher.workflow.name)
    except ClusterError:
        return ()
    return lost_pods_of(workflow) + disrupted_pods(cluster, launcher.workflow.name)


def lost_pods_of(workflow: Mapping[str, Any]) -> tuple[str, ...]:
    """Pod nodes of ``workflow`` that Argo marked Error 'pod deleted' (their display names)."""
    nodes = ((workflow.get("status") or {}).get("nodes") or {}).values()
    lost = [n for n in nodes if n.get("type") == "Pod" and n.get("phase") == "Error"]
    return tuple(n.get("displayName") or n.get("name", "") for n in lost if n.get("message") == LOST_POD_MESSAGE)


def disrupted_pods(cluster, workflow: str) -> tuple[str, ...]:
    """Failed pods of ``workflow`` that a disruption stopped (``DisruptionTarget`` True) or the kubelet did
    (:data:`KUBELET_STOPS`), as ``<pod> (<why>)``; () when they cannot be listed."""
    try:
        pods = cluster.list_pods(f"{WORKFLOW_POD_LABEL}={workflow}")
    except ClusterError:
        return ()
    found = []
    for pod in pods:
        status = pod.status
        if status is None or status.phase != "Failed":
            continue
        target = next(
            (c for c in status.conditions or [] if c.type == DISRUPTION_CONDITION and c.status == "True"), None
        )
        if target is not None or status.reason in KUBELET_STOPS:
            found.append(f"{pod.metadata.name} ({target.reason if target is not None else status.reason})")
    return tuple(found)
