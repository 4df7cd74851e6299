"""The run janitor: delete the jobs of runs that have ended, whoever was meant to and did not.

Why (issue 42.2, 42.3): the run's exit handler (llmft/components/lib/jobs/cleanup.py ``cleanup_run``) runs
once per run, not once per end of a run. KFP compiles it as an exit hook of the ``exit-handler-1`` DAG task
(kubeflow/pipelines 2.4.1 ``backend/src/v2/compiler/argocompiler/dag.go`` 55-100), so its node is
``<wf>.root.exit-handler-1.onExit``; a run Retry (``backend/src/common/util/workflow.go`` 220-231
``GenerateRetryExecution``, unchanged in 2.17.0) drops only nodes named ``<wf>.onExit*``, so a hook that
succeeded is carried forward, and Argo returns a finished node as it is (v3.4.17
``workflow/controller/operator.go`` 1821-1826): after a Retry, a second failure or a cancel has no exit
handler. A cancel may have none at all (kubeflow/pipelines#6101), and the launcher's SIGTERM handler
(llmft/components/lib/jobs/launcher_pod.py) has until the Argo emissary's next 1-s tick, uniformly 0-1 s
after the signal (argoexec ``signal_*.go`` 47-59): it loses that race whenever its API calls outlast the
tick. A kept job (an evicted launcher's, for the run's Retry) is meant to outlive the run's end for a while.

What: run by ``llmft pipeline janitor`` (deploy/janitor.yaml: a CronJob of the namespace, every 2 minutes),
for every unfinished job and Experiment of this project that carries a run id (``RUN_ID_LABEL``), read the
run's Argo Workflow (the job's ownerReference; else the Workflow KFP labelled ``pipeline/runid=<run id>``,
kubeflow/pipelines 2.4.1 ``backend/src/apiserver/template/v2_template.go`` 326):

* Running or Pending (a Retry makes a failed run Running again: ``GenerateRetryExecution``): kept;
* finished (Succeeded, Failed or Error, ``status.finishedAt`` set): deleted, with foreground propagation (the
  job goes once its pods have committed their SIGTERM checkpoint, so a Retry never meets them), unless kept
  for the run's Retry (:func:`~llmft.components.lib.jobs.cleanup.keep_reason`) and the run ended less than
  ``keep_for_retry_s`` ago;
* gone (the run was deleted): deleted (the garbage collector deletes those the Workflow owns anyway);
* not found or not readable: kept, and said.

So a job outlives its run by at most the janitor's period (plus ``keep_for_retry_s`` when kept for a Retry),
whatever ended the run and whether or not the exit handler or the launcher's SIGTERM handler ran. The
decision is :func:`verdict` (pure); :func:`sweep_orphans` reads the cluster and acts.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmft.components.lib.cluster import ClusterError
from llmft.components.lib.contracts.run_jobs import RUN_ID_LABEL, parse_time
from llmft.components.lib.jobs.backends import run_resources
from llmft.components.lib.jobs.cleanup import disrupted_pods, is_finished, keep_reason, lost_pods_of
from llmft.components.lib.jobs.launcher_pod import WORKFLOW

JANITOR_PERIOD_S = 120
"""How often the janitor runs: deploy/janitor.yaml's schedule, ``*/2 * * * *`` (a test holds the two equal)."""
KEEP_FOR_RETRY_S = 1800
"""How long after its run ended a job kept for the run's Retry keeps its GPUs (``--keep-for-retry-s``)."""
PART_OF = "app.kubernetes.io/part-of=kfp-llm-finetune"
"""Every job, trial template and Experiment this project creates carries it: nothing else is touched."""
WORKFLOW_RUN_LABEL = "pipeline/runid"
"""The label KFP puts on a run's Workflow (kubeflow/pipelines 2.4.1 ``backend/src/common/util/consts.go`` 43)."""
RUNNING, FINISHED = ("Pending", "Running", ""), ("Succeeded", "Failed", "Error")
GONE = object()
"""The run's Workflow does not exist (any more)."""


@dataclass
class Sweep:
    """What one janitor pass did, by ``Kind/name``."""

    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def verdict(
    obj: Mapping[str, Any], workflow: Any, *, now: float, keep_for_retry_s: float, evicted: tuple[str, ...] = ()
) -> tuple[str, str]:
    """("delete" | "keep", why) for the unfinished ``obj`` of a run whose Workflow is ``workflow`` (a dict,
    :data:`GONE`, or None when it could not be read); ``evicted``: that Workflow's pods a disruption or the
    kubelet stopped (cleanup.py ``disrupted_pods``)."""
    if workflow is None:
        return "keep", "its run's Workflow could not be read"
    if workflow is GONE:
        return "delete", "its run's Workflow is gone (the run was deleted)"
    name, status = workflow["metadata"]["name"], workflow.get("status") or {}
    phase = status.get("phase") or ""
    if phase not in FINISHED:
        return "keep", f"run's Workflow {name} is {phase or 'starting'}"
    ended = parse_time(status.get("finishedAt"))
    kept_for = keep_reason(obj, lost_pods=lost_pods_of(workflow) + evicted)
    if kept_for:
        since = now - ended if ended is not None else 0.0
        if since < keep_for_retry_s:
            left = keep_for_retry_s - since
            return "keep", f"kept for the run's Retry ({kept_for}) for {left:.0f}s more"
        return "delete", f"its run's Workflow {name} ended {phase} {since:.0f}s ago; kept for a Retry that did not come"
    return "delete", f"its run's Workflow {name} ended {phase}"


def sweep_orphans(
    cluster,
    *,
    keep_for_retry_s: float = KEEP_FOR_RETRY_S,
    now: float | None = None,
    dry_run: bool = False,
    print_fn: Callable[[str], Any] = print,
) -> Sweep:
    """One janitor pass over the cluster's namespace (see the module docstring)."""
    now = time.time() if now is None else now
    done, workflows = Sweep(), functools.cache(lambda ref: _workflow(cluster, *ref))
    evicted = functools.cache(lambda name: disrupted_pods(cluster, name))
    for group, version, plural, kind in run_resources():
        try:  # no retries: the next pass comes in JANITOR_PERIOD_S
            items = cluster.list_custom_objects(group, version, plural, label_selector=f"{RUN_ID_LABEL},{PART_OF}")
        except ClusterError as exc:
            if exc.status is None:  # no answer, or no configuration: the other kinds would say the same
                raise
            if exc.status != 404:  # 404: this kind's CRD is not installed
                done.problems.append(f"{kind}s: {exc}")
            continue
        for obj in items:
            if is_finished(obj) or (obj.get("metadata") or {}).get("deletionTimestamp"):
                continue
            workflow = workflows(_workflow_ref(obj))
            ended = isinstance(workflow, dict) and (workflow.get("status") or {}).get("phase") in FINISHED
            stopped = evicted(workflow["metadata"]["name"]) if ended else ()
            action, why = verdict(obj, workflow, now=now, keep_for_retry_s=keep_for_retry_s, evicted=stopped)
            target = (group, version, plural, obj["metadata"]["name"])
            _act(cluster, target, kind, action, why, done, dry_run, print_fn)
    return done


def _act(cluster, target: tuple, kind: str, action: str, why: str, done: Sweep, dry_run: bool, print_fn) -> None:
    what = f"{kind}/{target[3]}"
    if action == "keep":
        done.kept.append(what)
        print_fn(f"kept unfinished {kind} {cluster.namespace}/{target[3]}: {why}")
        return
    if not dry_run:
        try:
            cluster.delete_custom_object(*target, propagation="Foreground")
        except ClusterError as exc:
            if exc.status != 404:
                done.problems.append(f"{what}: {exc}")
                print_fn(f"warning: could not delete {kind} {cluster.namespace}/{target[3]} ({why}): {exc}")
                return
    done.deleted.append(what)
    print_fn(f"{'would delete' if dry_run else 'deleted'} unfinished {kind} {cluster.namespace}/{target[3]}: {why}")


def _workflow_ref(obj: Mapping[str, Any]) -> tuple[str, str]:
    """("name", <Workflow name>) from the object's ownerReference, else ("run", <run id>)."""
    meta = obj.get("metadata") or {}
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("kind") == "Workflow"), None)
    if owner is not None:
        return "name", owner["name"]
    return "run", (meta.get("labels") or {}).get(RUN_ID_LABEL, "")


def _workflow(cluster, by: str, value: str) -> Any:
    """The run's Workflow (dict), GONE, or None when it cannot be read or found."""
    try:
        if by == "name":
            return cluster.get_custom_object(*WORKFLOW, value)
        found = cluster.list_custom_objects(*WORKFLOW, label_selector=f"{WORKFLOW_RUN_LABEL}={value}")
    except ClusterError as exc:
        return GONE if exc.status == 404 and by == "name" else None
    return found[0] if found else None
