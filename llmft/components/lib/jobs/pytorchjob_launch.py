"""The pytorchjob backend on a cluster: submit the run's PyTorchJob, or re-attach to it, and wait for it.

:func:`build_job_spec` turns the plan's :class:`~llmft.components.lib.plan.build.JobPlan` and the
trainer's launch (``--config`` the plan's config.yaml, then ``data=`` and a sweep's best) into a
:class:`JobSpec` (image, resources, node selector, Secrets, the data
PVC at the plan's mount path, the run-id label, ``activeDeadlineSeconds`` = the plan's job timeout,
``cleanPodPolicy: Running``); Katib trials are built by the same function. :func:`attach_pytorchjob`
runs it (the registry's ``attach``, llmft/components/lib/jobs/backends.py). What a real cluster
does, and what this module does about it (each upstream rule is
played by tests/k8s/cluster_sim.py, which runs this code against real `llmft train` processes):

* **Retries re-attach.** The job name derives from the pipeline run id, so a retried task (KFP
  ``set_retry``) finds the job its previous attempt created. A Created/Running/Restarting job is
  watched again, never deleted; a Succeeded one is not run again.
* **A permanent failure is final.** Under ``restartPolicy: ExitCode`` the Training Operator fails
  the job when a replica exits 1-127 (kubeflow/trainer v1.9.4 ``pkg/util/train/train_util.go``
  24-26, ``pkg/controller.v1/common/pod.go`` 349-373). The trainer exits 1 for bad input and once
  its restart budget is spent (llmft/trainer/rundir.py), so such a job is never recreated: the step fails
  (:class:`JobFailedPermanently`, exit 1) with the failing pod's log tail. A job that failed
  otherwise (backoff limit, lost pods) is deleted and recreated by a retry; the trainer resumes
  from the newest complete checkpoint in the (equally stable) run directory.
* **Time is bounded by the job itself.** ``activeDeadlineSeconds`` is the plan's ``training_timeout_s``
  (the plan keeps it below the train task's own timeout); the operator fails the job when it runs
  longer (``pkg/core/job.go`` 81-91, ``pkg/controller.v1/common/job.go`` 211-213). The launcher waits
  until that deadline (from the job's ``startTime``, also after a re-attach) and reports the end as
  a timeout (:class:`JobTimedOut`, exit 200), never as a training failure.
* **The API server may blink.** Transient API errors (no answer, 429, 5xx) inside the wait are
  retried, at most ``api_retries`` in a row.
* **Pending is explained.** When pods stay Pending, their events and waiting reasons (no GPU, an
  untolerated taint, an unbound PVC, ImagePullBackOff, a missing Secret) are printed, at most once
  every ``pending_every`` polls.
* **Cancel frees GPUs; eviction does not.** SIGTERM deletes the job when the run was cancelled or
  timed out, and keeps it when this pod was evicted (the retry re-attaches): llmft/components/lib/jobs/cleanup.py
  ``sigterm_cause``. The job is owned by the run's Argo Workflow, never by this pod.
* **A recreated job never meets its predecessor.** A failed job is deleted with foreground
  propagation and recreated only once it and its pods are gone (:func:`wait_until_gone`).
* **Pods that never start are counted.** The operator recreates a pod whose container never ran
  (exit ``0xbeef``) without end; after ``NEVER_STARTED_LIMIT`` such recreations the job is deleted
  and the step fails with the pods' reasons (llmft/components/lib/jobs/pod_starts.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmft.components.lib.cluster import (
    PYTORCHJOB_CONTAINER,
    ClusterError,
    call_with_retries,
)
from llmft.components.lib.contracts.schema import (
    JOB_WAIT_GRACE_S,
    JobFailedPermanently,
    JobTimedOut,
    TrainingJobFailed,
    parse_time,
)
from llmft.components.lib.jobs import pod_starts
from llmft.components.lib.jobs.launcher_pod import LauncherPod, delete_on_sigterm, read_launcher_pod, unmark_kept
from llmft.components.lib.jobs.lifecycle import EarlierJob, delete_and_wait, settle_earlier_attempt
from llmft.components.lib.jobs.pending_pods import PendingReporter
from llmft.components.lib.jobs.pod_starts import JobNeverStarts
from llmft.components.lib.jobs.pytorchjob_logs import MasterLogFollower
from llmft.components.lib.jobs.pytorchjob_spec import (
    GROUP,
    JOB_NAME_LABEL,
    JOB_ROLE_LABEL,
    KIND,
    PLURAL,
    RESOURCE,
    VERSION,
    build_job_spec,
    build_pytorchjob,
)
from llmft.trainer.errors import EXIT_CODE_MEANINGS, LlmftError
from llmft.trainer.io import TRAINING_MANIFEST

API_RETRIES = 10
"""Transient API errors in a row the wait loop tolerates before it gives up."""
PENDING_EVERY = 10
"""Polls between two reports of why pods are Pending (30 s polls: every 5 minutes)."""
DEADLINE_MESSAGE = "active longer than specified deadline"
"""What the operator writes into the Failed condition when activeDeadlineSeconds ends a job
(kubeflow/trainer v1.9.4 pkg/controller.v1/common/job.go 212)."""


# --- the pytorchjob backend's attach (llmft/components/lib/jobs/backends.py runs it) --------------------


def attach_pytorchjob(
    job,
    launch,
    *,
    cluster,
    launcher: LauncherPod,
    owner: dict | None,
    poll_s: float = 30.0,
    print_fn: Callable[[str], Any] = print,
    api_retries: int = API_RETRIES,
    pending_every: int = PENDING_EVERY,
) -> dict:
    """The plan's job (``job``, a JobPlan) as a PyTorchJob running ``launch`` (a TrainerLaunch): submitted,
    or re-attached to, and waited for (see :func:`run_job`)."""
    return run_job(
        cluster,
        build_job_spec(job, launch),
        timeout_s=float(job.timeout_s),
        poll_s=poll_s,
        print_fn=print_fn,
        api_retries=api_retries,
        pending_every=pending_every,
        owner=owner,
        launcher=launcher,
    )


def run_job(
    cluster,
    spec,
    *,
    timeout_s: float,
    poll_s: float = 30.0,
    print_fn: Callable[[str], Any] = print,
    api_retries: int = API_RETRIES,
    pending_every: int = PENDING_EVERY,
    owner: dict | None = None,
    launcher: LauncherPod | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], Any] = time.sleep,
) -> dict:
    """Submit the PyTorchJob of ``spec`` (a JobSpec), or re-attach to it, and wait for its end
    (the module docstring lists the rules). SIGTERM deletes it on a cancel. ``launcher``: this pod as
    read before training (default: read now); ``owner``: the job's ownerReference (default: the run's
    Argo Workflow when in a KFP pod, else none). ``clock`` (seconds since the epoch, compared with the
    job's ``startTime``) and ``sleep`` are the wall clock unless a test injects its own."""

    if poll_s <= 0 or timeout_s < poll_s:
        raise ValueError(f"need 0 < poll_s ({poll_s}) <= timeout_s ({timeout_s})")
    name, namespace = spec.name, cluster.namespace
    launcher = launcher if launcher is not None else read_launcher_pod(cluster, print_fn=print_fn)
    owner = owner if owner is not None else launcher.owner_reference()
    sigterm = delete_on_sigterm(
        cluster, GROUP, VERSION, PLURAL, name, namespace=namespace, print_fn=print_fn, launcher=launcher
    )
    with sigterm:
        earlier = earlier_pytorchjob(cluster, name, namespace, api_retries, print_fn)
        previous = settle_earlier_attempt(earlier, poll_s=poll_s, print_fn=print_fn)  # lifecycle.py, shared
        state = job_state(cluster, previous) if previous is not None else "absent"
        if state == "succeeded":
            print_fn(f"PyTorchJob {name} already Succeeded (an earlier attempt of this task): not running it again")
            return {"name": name, "namespace": namespace, "succeeded": True, "reused": True}
        if state == "active" and previous is not None:
            print_fn(f"PyTorchJob {namespace}/{name} is still running from an earlier attempt: re-attaching to it")
            unmark_kept(cluster, (GROUP, VERSION, PLURAL, name), previous, namespace)
        elif state in ("permanent", "deadline") and previous is not None:
            raise_for_failure(cluster, previous, earlier=True)
        else:
            if state == "failed":
                print_fn(f"PyTorchJob {name} failed in an earlier attempt (not permanently): recreating it")
                delete_and_wait(cluster, earlier, poll_s=min(poll_s, 5.0))
            _submit(cluster, spec, owner, print_fn)
        final = wait_for_job(
            cluster,
            name,
            namespace,
            timeout_s=timeout_s,
            poll_s=poll_s,
            print_fn=print_fn,
            api_retries=api_retries,
            pending_every=pending_every,
            clock=clock,
            sleep=sleep,
        )
    return {
        "name": name,
        "namespace": namespace,
        "succeeded": True,
        "reattached": state == "active",
        "conditions": _conditions(final),
        "start_time": (final.get("status") or {}).get("startTime"),
        "completion_time": (final.get("status") or {}).get("completionTime"),
    }


def _submit(cluster, spec, owner: dict | None, print_fn) -> None:
    """Create the PyTorchJob through the Training Operator SDK's TrainingClient."""
    from kubernetes import client as k8s  # heavy: kubernetes

    job = build_pytorchjob(spec)
    if owner:
        job.metadata.owner_references = [
            k8s.V1OwnerReference(
                api_version=owner["apiVersion"],
                kind=owner["kind"],
                name=owner["name"],
                uid=owner["uid"],
                block_owner_deletion=owner.get("blockOwnerDeletion", False),
            )
        ]
    job.metadata.namespace = cluster.namespace
    cluster.training_client(KIND).create_job(job=job, namespace=cluster.namespace)
    owned = f", owned by {owner['kind']} {owner['name']}" if owner else ""
    print_fn(f"created PyTorchJob {cluster.namespace}/{spec.name}{owned}")


# --- reading a job's state -----------------------------------------------------------------------


def _conditions(job: dict) -> list[dict]:
    return list((job.get("status") or {}).get("conditions") or [])


def _condition(job: dict, kind: str) -> dict | None:
    return next((c for c in _conditions(job) if c.get("type") == kind and c.get("status") == "True"), None)


def _job_pods(cluster, name: str, namespace: str) -> list:

    return cluster.list_pods(f"{JOB_NAME_LABEL}={name}", namespace=namespace)


def _exit_codes(pod) -> list[int]:
    """Exit codes of the pod's ``pytorch`` container (current and last state)."""

    codes = []
    for status in (pod.status.container_statuses or []) if pod.status else []:
        if status.name != PYTORCHJOB_CONTAINER:
            continue
        for state in (status.state, status.last_state):
            if state is not None and state.terminated is not None:
                codes.append(int(state.terminated.exit_code))
    return codes


def permanent_exit(cluster, name: str, namespace: str) -> tuple[str, int] | None:
    """(pod, code) of a replica that exited 1-127 (ExitCode: permanent), or None."""
    for pod in _job_pods(cluster, name, namespace):
        for code in _exit_codes(pod):
            if 1 <= code <= 127:
                return pod.metadata.name, code
    return None


def job_state(cluster, job: dict) -> str:
    """succeeded | active | permanent (a replica exited 1-127) | deadline | failed (anything else)."""
    if _condition(job, "Succeeded"):
        return "succeeded"
    failed = _condition(job, "Failed")
    if failed is None:
        return "active"
    if DEADLINE_MESSAGE in (failed.get("message") or ""):
        return "deadline"
    name, namespace = job["metadata"]["name"], job["metadata"].get("namespace") or cluster.namespace
    return "permanent" if permanent_exit(cluster, name, namespace) else "failed"


def _get_job(cluster, name: str, namespace: str, api_retries: int, print_fn) -> dict | None:

    try:
        return call_with_retries(
            lambda: cluster.get_custom_object(GROUP, VERSION, PLURAL, name, namespace=namespace),
            attempts=api_retries,
            what=f"get PyTorchJob {name}",
            print_fn=print_fn,
        )
    except ClusterError as exc:
        if exc.status == 404:
            return None
        raise


def earlier_pytorchjob(cluster, name: str, namespace: str, api_retries: int, print_fn) -> EarlierJob:
    """The PyTorchJob ``name`` as the shared lifecycle (llmft/components/lib/jobs/lifecycle.py) reads it."""
    return EarlierJob(
        RESOURCE,
        name,
        namespace,
        get=lambda: _get_job(cluster, name, namespace, api_retries, print_fn),
        pods=lambda: _job_pods(cluster, name, namespace),
    )


def pod_log_tail(cluster, pod: str, namespace: str, lines: int = 50) -> str:

    try:
        text = cluster.read_pod_log(pod, container=PYTORCHJOB_CONTAINER, tail_lines=lines, namespace=namespace)
    except ClusterError as exc:
        return f"(the log of pod {pod} could not be read: {exc})"
    tail = text.splitlines()[-lines:]
    return f"last {len(tail)} log lines of pod {pod}:\n" + "\n".join(f"  {line}" for line in tail)


def _master_tail(cluster, name: str, namespace: str, lines: int) -> str:

    try:
        pods = cluster.list_pods(f"{JOB_NAME_LABEL}={name},{JOB_ROLE_LABEL}=master", namespace=namespace)
    except LlmftError as exc:
        return f"(the master's log could not be read: {exc})"
    if not pods:
        return "(no master pod left: the pod never started or was deleted; `kubectl describe pytorchjob` tells more)"
    return "\n".join(pod_log_tail(cluster, p.metadata.name, namespace, lines) for p in pods)


def raise_for_failure(cluster, job: dict, *, earlier: bool = False, lines: int = 50) -> None:
    """Raise the error that says why ``job`` Failed: permanent exit, deadline, or other."""

    name, namespace = job["metadata"]["name"], job["metadata"].get("namespace") or cluster.namespace
    failed = _condition(job, "Failed") or {}
    why = f"{failed.get('reason') or 'Failed'}: {failed.get('message') or ''}".strip()
    when = " in an earlier attempt of this task" if earlier else ""
    if DEADLINE_MESSAGE in why:
        raise JobTimedOut(
            f"PyTorchJob {namespace}/{name} ran into its activeDeadlineSeconds{when} ({why}): a timeout, not a "
            f"training failure. Raise job_timeout_s, or resume by re-running the pipeline (the run directory keeps "
            f"its checkpoints).\n{_master_tail(cluster, name, namespace, lines)}"
        )
    exit_ = permanent_exit(cluster, name, namespace)
    if exit_ is not None:
        pod, code = exit_
        meaning = EXIT_CODE_MEANINGS.get(code, "a permanent failure: exit codes 1-127 are never retried")
        raise JobFailedPermanently(
            f"PyTorchJob {namespace}/{name} failed permanently{when}: pod {pod} exited {code} ({meaning}). It is not "
            f"recreated: fix the cause, then re-run the pipeline.\n{pod_log_tail(cluster, pod, namespace, lines)}"
        )
    raise TrainingJobFailed(
        f"PyTorchJob {namespace}/{name} Failed{when} ({why}); a retry of this task recreates it and resumes from the "
        f"newest checkpoint.\n{_master_tail(cluster, name, namespace, lines)}"
    )


# --- waiting ------------------------------------------------------------------------------------


def wait_deadline(job: dict, timeout_s: float, now: float) -> float:
    """Wall-clock time to stop waiting: the job's own deadline (startTime + activeDeadlineSeconds,
    also for a job this attempt re-attached to) plus a grace for the operator to mark it, or
    ``timeout_s`` (+ grace) from ``now`` before the operator set a startTime."""
    started = parse_time((job.get("status") or {}).get("startTime"))
    deadline = ((job.get("spec") or {}).get("runPolicy") or {}).get("activeDeadlineSeconds")
    if started is not None and deadline:
        return started + float(deadline) + JOB_WAIT_GRACE_S
    return now + timeout_s + JOB_WAIT_GRACE_S


def wait_for_job(
    cluster,
    name: str,
    namespace: str,
    *,
    timeout_s: float,
    poll_s: float = 30.0,
    print_fn: Callable[[str], Any] = print,
    api_retries: int = API_RETRIES,
    pending_every: int = PENDING_EVERY,
    log_tail: int = 50,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], Any] = time.sleep,
) -> dict:
    """Poll the job until Succeeded (returned) or Failed (:func:`raise_for_failure`), streaming the
    master's log, explaining Pending pods, retrying transient API errors; JobTimedOut past the deadline
    (read on ``clock``, the wall clock the operator's ``startTime`` is written in)."""

    follow = MasterLogFollower(cluster, name, namespace, print_fn)
    pending = PendingReporter(cluster, f"{JOB_NAME_LABEL}={name}", namespace, every=pending_every, print_fn=print_fn)
    starts = _start_watcher(f"PyTorchJob {namespace}/{name}", lambda pod: cluster.list_events(pod, namespace=namespace))
    errors, started = 0, clock()
    while True:
        try:
            job = _get_job(cluster, name, namespace, 1, print_fn)
            errors = 0
        except ClusterError as exc:
            errors += 1
            if not exc.transient or errors > api_retries:
                raise
            print_fn(f"warning: reading PyTorchJob {name}: {exc} ({errors}/{api_retries}); retrying")
            sleep(min(poll_s * errors, 60.0))
            continue
        if job is None:
            raise LlmftError(
                f"PyTorchJob {namespace}/{name} was deleted while this step waited for it (by hand, or by the run's "
                "cleanup): nothing to wait for"
            )
        until = wait_deadline(job, timeout_s, started)
        follow(job)
        if _condition(job, "Succeeded"):
            return job
        if _condition(job, "Failed"):
            raise_for_failure(cluster, job, lines=log_tail)
        _check_starts(cluster, starts, name, namespace)
        pending()
        if clock() > until:
            raise JobTimedOut(
                f"PyTorchJob {namespace}/{name} did not finish by its deadline (+{JOB_WAIT_GRACE_S}s): a timeout, not "
                f"a training failure. A retry of this task re-attaches to the job while it runs.\n"
                f"{_master_tail(cluster, name, namespace, log_tail)}"
            )
        sleep(poll_s)


def _start_watcher(what: str, events: Callable[[str], list] | None = None):
    """A StartWatcher (llmft/components/lib/jobs/pod_starts.py) for the ``pytorch`` containers of a job; ``events``
    (pod name -> its events) tells whether a pod replaced between two polls had started."""

    return pod_starts.StartWatcher(what, PYTORCHJOB_CONTAINER, limit=pod_starts.NEVER_STARTED_LIMIT, events=events)


def _check_starts(cluster, starts, name: str, namespace: str) -> None:
    """Feed this poll's pods to ``starts``; when its pods never start, delete the job and re-raise."""

    try:
        starts(_job_pods(cluster, name, namespace))
    except ClusterError:
        return  # the next poll reads them
    except JobNeverStarts:
        cluster.delete_custom_object(GROUP, VERSION, PLURAL, name, namespace=namespace, propagation="Foreground")
        raise


# --- reading a finished run ---------------------------------------------------------------------


def read_training_manifest(run_dir: str | Path) -> dict[str, Any]:
    """``<run>/final/training_manifest.json`` (written by the trainer at the end of a run)."""
    path = Path(run_dir) / "final" / TRAINING_MANIFEST
    if not path.is_file():
        raise LlmftError(f"{path} is missing: the training run did not finish (no final/ folder in {run_dir})")
    return json.loads(path.read_text())


def training_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """Scalars of a training manifest for the step's KFP Metrics (final/best eval, tokens, time)."""
    out: dict[str, float] = {}
    for prefix, block in (("final", manifest.get("final_metrics") or {}), ("best", manifest.get("best") or {})):
        for key, value in block.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
                out[f"{prefix}_{key}"] = float(value)
    for key in ("steps", "tokens_seen", "wall_time_s", "world_size"):
        value = manifest.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out
