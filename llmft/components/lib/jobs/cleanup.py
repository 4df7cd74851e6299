"""Cancelled or failed runs free their GPUs: the jobs a run started are found by its run-id label.

Three mechanisms, each for a way a run can end while a job still holds GPUs:

* **SIGTERM in the launcher** (:func:`~llmft.components.lib.jobs.launcher_pod.delete_on_sigterm`), when the run
  was cancelled or timed out.
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
  two apart from what the cluster shows (llmft/components/lib/jobs/launcher_pod.py); only a cancel or a
  timeout deletes the job.
  The job's pods get SIGTERM in turn, so the trainer commits a checkpoint first.
* **The exit handler** (:func:`cleanup_run`, the ``cleanup-run`` task of both pipelines). When the
  body of the pipeline fails (a task failed after its retries, a launcher timed out, a launcher pod
  was lost), it deletes every job and Experiment labelled with the run id that has not finished.
  It never reads the run's final state (``dsl.PipelineTaskFinalStatus`` is "not supported yet" by
  the Argo compiler of KFP 2.4/2.5, ``backend/src/v2/compiler/argocompiler/dag.go`` 612-613 at 2.4.1): a finished
  job (Succeeded or Failed) holds no GPU and its pods keep their logs, so only unfinished ones go.
  After a cancel the hook may not run at all (kubeflow/pipelines#6101: "Step exceeded its
  deadline"); the SIGTERM handler covers that case.
* **ownerReferences** (:func:`~llmft.components.lib.jobs.launcher_pod.run_owner_reference`). Jobs and
  Experiments are owned by the run's Argo
  Workflow (the owner of the launcher pod, ``workflow/controller/workflowpod.go`` 172-173), never by
  the launcher pod: a pod is deleted and replaced on every KFP retry and on eviction, which would
  delete the healthy job the retry should re-attach to. The Workflow lives across retries and is
  deleted with the run, or by KFP's persistence agent 7 days after the run ends
  (``backend/src/agent/persistence/main.go`` 163, ``worker/workflow_saver.go`` 64); the garbage
  collector then deletes the jobs too. Katib trials are owned by their Experiment already.

No real cluster runs in the tests: tests/k8s/cluster_sim.py plays the controllers these rely on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.cluster import ClusterError, call_with_retries
from llmft.components.lib.jobs.backends import run_resources
from llmft.components.lib.jobs.launcher_pod import KEEP_ANNOTATION, WORKFLOW, read_launcher_pod
from llmft.components.lib.plan.schema import RUN_ID_LABEL, on_kfp_cluster, run_label

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
    launcher = read_launcher_pod(cluster, environ=environ, print_fn=lambda _line: None)
    if launcher.workflow is None:
        return ()
    try:
        workflow = cluster.get_custom_object(*WORKFLOW, launcher.workflow.name)
    except ClusterError:
        return ()
    nodes = ((workflow.get("status") or {}).get("nodes") or {}).values()
    lost = [n for n in nodes if n.get("type") == "Pod" and n.get("phase") == "Error"]
    return tuple(n.get("displayName") or n.get("name", "") for n in lost if n.get("message") == LOST_POD_MESSAGE)
