"""One job lifecycle for every cluster backend (issue 48.2): submit the job or attach to the one an earlier attempt
of the train task left, wait for its end within its budget, tell a permanent failure from a retryable one, delete a
failed job and wait until it is gone before recreating it, and end a failure with its pods' log tail.

A backend adapts it with a :class:`JobAdapter` (its kind, how to read its job and tell its phase, its pods, how to
submit it, what a permanent failure is, its log tail); llmft/components/lib/jobs/pytorchjob_launch.py and
trainjob_launch.py are the two adapters the project ships, tests/k8s/toy_backend.py is a toy one.

* :func:`settle_earlier_attempt`: a job of an earlier attempt that is being deleted (a cancel's SIGTERM, the exit
  handler or the janitor: foreground, so it stays until its pods committed their SIGTERM checkpoint), or the pods
  of one deleted in the background that still stop, are waited out before anything is decided;
* :func:`submit_or_attach`: a Succeeded job is not run again, a running one is re-attached to (never deleted), a
  permanently failed one fails the step at once (the adapter's ``raise_if_final``: never recreated), any other
  failed one is deleted and recreated, none is submitted;
* :func:`delete_and_wait`: a Failed job is deleted with foreground propagation and waited out before it is
  recreated under the same name (:func:`llmft.components.lib.cluster.wait_until_gone` says why);
* :func:`job_deadline`: the budget, the job's own deadline (its start, as its controller stamps it, plus its
  ``activeDeadlineSeconds``) plus a grace, also for a job re-attached to, so a retry never starts the budget again;
* :func:`poll_until_end`: the wait, one read a poll, transient API errors retried ``api_retries`` in a row, the
  adapter's ``follow`` (log streaming) and ``while_running`` (Pending reports, never-started pods) each poll, the
  failure raised by the adapter (permanent, deadline, or retryable: each with the log tail), :class:`JobTimedOut`
  past the deadline;
* :func:`run_lifecycle`: all of it inside the launcher's SIGTERM guard (a cancel deletes the job, an eviction
  keeps it: llmft/components/lib/jobs/launcher_pod.py).

An adapter may bring its own wait where its upstream SDK has one (the TrainJob's ``wait_for_job_status``): it is
handed the same budget and raises through the same adapter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from llmft.components.lib.cluster import RECREATE_WAIT_S, ClusterError, wait_until_gone
from llmft.components.lib.contracts.run_jobs import JOB_WAIT_GRACE_S, JobTimedOut
from llmft.components.lib.jobs.launcher_pod import LauncherPod, delete_on_sigterm, unmark_kept
from llmft.katib.trial_kinds import JobResource
from llmft.trainer.errors import LlmftError

API_RETRIES = 10
"""Transient API errors in a row the wait tolerates before it gives up."""
PENDING_EVERY = 10
"""Polls between two reports of why pods are Pending (30 s polls: every 5 minutes)."""
SUCCEEDED, RUNNING, FAILED = "succeeded", "running", "failed"
"""A job's phase as the lifecycle reads it (:meth:`JobAdapter.phase`)."""
REUSED, ATTACHED, CREATED = "reused", "attached", "created"
"""What :func:`submit_or_attach` did."""


@dataclass(frozen=True)
class EarlierJob:
    """One job under the name an earlier attempt of this task used, as the shared lifecycle reads it."""

    resource: JobResource
    name: str
    namespace: str
    get: Callable[[], dict | None]
    """The job as the API server has it, None when there is none."""
    pods: Callable[[], list]
    """Its pods (Kubernetes pod objects), by its job-name label."""
    pods_word: str = "pods"
    """How its log names them ("node pods" for a TrainJob's)."""

    @property
    def what(self) -> str:
        return f"{self.resource.kind} {self.namespace}/{self.name}"


@dataclass(frozen=True)
class ClusterRun:
    """What a cluster backend's ``attach`` (llmft/components/lib/jobs/backends.py) is handed: the plan's job
    (``job``, a JobPlan) running ``launch`` (a TrainerLaunch) on ``cluster``; ``launcher``: the launcher pod as
    read before training (its SIGTERM guard needs it); ``owner``: the job's ownerReference (the run's Workflow);
    ``api_retries``: transient API errors in a row the wait survives; ``pending_every``: polls between two
    reports of why a pod is Pending."""

    job: Any
    launch: Any
    cluster: Any
    launcher: LauncherPod
    owner: dict | None
    poll_s: float = 30.0
    print_fn: Callable[[str], Any] = print
    api_retries: int = API_RETRIES
    pending_every: int = PENDING_EVERY


class JobAdapter(Protocol):
    """One backend's job as the lifecycle drives it; ``job`` below is the job as the API server returns it. A
    backend's adapter may subclass this to take the defaults of ``read``, ``follow``, ``while_running`` and
    ``log_tail`` (a toy backend then writes five members: tests/k8s/toy_backend.py)."""

    job: EarlierJob
    """Its kind, name, namespace, one read (None: there is none) and its pods."""

    @property
    def succeeded_word(self) -> str:
        """How its controller names success in its conditions ("Succeeded", "Complete")."""
        ...

    def read(self) -> dict | None:
        """One read of the job for a poll (None: it is gone); a ClusterError is raised, the wait retries a
        transient one. Default: ``job.get``."""
        return self.job.get()

    def phase(self, job: dict) -> str:
        """:data:`SUCCEEDED`, :data:`RUNNING` or :data:`FAILED` (also: stopped for good by this launcher)."""
        ...

    def raise_if_final(self, job: dict, *, earlier: bool) -> None:
        """For a failed job: raise JobFailedPermanently (never recreated) or JobTimedOut (its deadline ended it),
        each with the log tail; return when a retry may recreate it. ``earlier``: an earlier attempt's job."""
        ...

    def retryable_failure(self, job: dict) -> Exception:
        """The error of a job that failed otherwise (a retry recreates it), with the log tail."""
        ...

    def submit(self) -> None:
        """Create the job (with its ownerReference) and say so."""
        ...

    def started_at(self, job: dict) -> tuple[float | None, float | None]:
        """(when its deadline clock started, its activeDeadlineSeconds), None where not (yet) set."""
        ...

    def follow(self, job: dict) -> None:
        """Each poll, before the verdict: stream the leader's new log lines. Default: nothing."""
        return None

    def while_running(self, job: dict) -> None:
        """Each poll of a job still running: explain Pending pods, count pods that never start (raising once
        they never will). Default: nothing."""
        return None

    def log_tail(self, lines: int) -> str:
        """The last ``lines`` log lines of the pod that tells most (the failing one, else the leader). Default:
        where to look."""
        return f"(`kubectl describe` the {self.job.what} and its pods for the reason)"


def wait_gone(job: EarlierJob, *, poll_s: float, timeout_s: float = RECREATE_WAIT_S) -> None:
    """Wait until the job and its pods are gone: a new job's pods beside them would collide with their names and
    share the run directory with a trainer still writing to it."""
    wait_until_gone(
        job.what,
        lambda: job.get() is not None,
        lambda: [p.metadata.name for p in job.pods()],
        timeout_s=timeout_s,
        poll_s=poll_s,
    )


def settle_earlier_attempt(job: EarlierJob, *, poll_s: float, print_fn: Callable[[str], Any]) -> dict | None:
    """The job an earlier attempt left, once nothing of it is still going away: None when there is none (or it was
    being deleted, or only its stopping pods were left, and is gone now), else the job."""
    previous = job.get()
    if previous is not None and (previous.get("metadata") or {}).get("deletionTimestamp"):
        print_fn(f"{job.what} of an earlier attempt is being deleted: waiting until it is gone")
    elif previous is None and job.pods():
        print_fn(
            f"{job.pods_word} of an earlier {job.resource.kind} {job.namespace}/{job.name} are still stopping: "
            "waiting until they are gone"
        )
    else:
        return previous
    wait_gone(job, poll_s=min(poll_s, 5.0))
    return None


def delete_and_wait(cluster, job: EarlierJob, *, poll_s: float, timeout_s: float = RECREATE_WAIT_S) -> None:
    """Delete the job with foreground propagation (its pods go first: each owner reference blocks its owner's
    deletion) and wait until it and its pods are gone, so the job recreated under the same name never meets them."""
    group, version, plural, _ = job.resource
    try:
        cluster.delete_custom_object(
            group, version, plural, job.name, namespace=job.namespace, propagation="Foreground"
        )
    except ClusterError as exc:
        if exc.status != 404:
            raise
    wait_gone(job, poll_s=poll_s, timeout_s=timeout_s)


def submit_or_attach(cluster, adapter: JobAdapter, *, poll_s: float, print_fn: Callable[[str], Any]) -> str:
    """Submit the job, or find the one an earlier attempt of this task left under the same name: :data:`REUSED`
    (it succeeded: not run again), :data:`ATTACHED` (still running: watched again, never deleted) or
    :data:`CREATED` (none, or a failed one deleted first: the trainer resumes from the newest complete
    checkpoint). A permanently failed one raises (the adapter's ``raise_if_final``) and is never recreated."""
    earlier = adapter.job
    previous = settle_earlier_attempt(earlier, poll_s=poll_s, print_fn=print_fn)
    phase = adapter.phase(previous) if previous is not None else None
    if previous is not None and phase == SUCCEEDED:
        print_fn(
            f"{earlier.what} already {adapter.succeeded_word} (an earlier attempt of this task): not running it again"
        )
        return REUSED
    if previous is not None and phase == RUNNING:
        print_fn(f"{earlier.what} is still running from an earlier attempt: re-attaching to it")
        unmark_kept(cluster, (*earlier.resource[:3], earlier.name), previous, earlier.namespace)
        return ATTACHED
    if previous is not None:
        adapter.raise_if_final(previous, earlier=True)
        why = _failed_reason(previous)
        print_fn(f"{earlier.what} failed in an earlier attempt (not permanently{why}): recreating it")
        delete_and_wait(cluster, earlier, poll_s=min(poll_s, 5.0))
    adapter.submit()
    return CREATED


def _failed_reason(job: dict) -> str:
    conditions = (job.get("status") or {}).get("conditions") or []
    failed = [c for c in conditions if c.get("type") == "Failed" and c.get("status") == "True"]
    return f": {failed[-1]['reason']}" if failed and failed[-1].get("reason") else ""


def job_deadline(started_at: tuple[float | None, float | None], timeout_s: float, now: float) -> float:
    """Wall-clock time to stop waiting: the job's own deadline (its start plus activeDeadlineSeconds, also for a
    job this attempt re-attached to) plus a grace for its controller to mark it, or ``timeout_s`` (+ grace) from
    ``now`` before the controller stamped a start. ``started_at``: the adapter's (start, activeDeadlineSeconds)."""
    started, deadline_s = started_at
    if started is not None and deadline_s:
        return started + float(deadline_s) + JOB_WAIT_GRACE_S
    return now + timeout_s + JOB_WAIT_GRACE_S


def poll_until_end(
    adapter: JobAdapter,
    *,
    timeout_s: float,
    poll_s: float,
    print_fn: Callable[[str], Any] = print,
    api_retries: int = API_RETRIES,
    log_tail: int = 50,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], Any] = time.sleep,
) -> dict:
    """Poll the job until it succeeded (returned) or failed (the adapter's error, with its log tail), calling
    the adapter's ``follow`` and ``while_running`` each poll; transient API errors are retried at most
    ``api_retries`` in a row; JobTimedOut past :func:`job_deadline` (read on ``clock``, the wall clock the
    controller's timestamps are written in)."""
    what, errors, started = adapter.job.what, 0, clock()
    while True:
        try:
            job = adapter.read()
            errors = 0
        except ClusterError as exc:
            errors += 1
            if not exc.transient or errors > api_retries:
                raise
            print_fn(f"warning: reading {what}: {exc} ({errors}/{api_retries}); retrying")
            sleep(min(poll_s * errors, 60.0))
            continue
        if job is None:
            raise LlmftError(
                f"{what} was deleted while this step waited for it (by hand, or by the run's cleanup): "
                "nothing to wait for"
            )
        until = job_deadline(adapter.started_at(job), timeout_s, started)
        adapter.follow(job)
        phase = adapter.phase(job)
        if phase == SUCCEEDED:
            return job
        if phase == FAILED:
            adapter.raise_if_final(job, earlier=False)
            raise adapter.retryable_failure(job)
        adapter.while_running(job)
        if clock() > until:
            raise JobTimedOut(
                f"{what} did not finish by its deadline (+{JOB_WAIT_GRACE_S}s): a timeout, not a training failure. "
                f"A retry of this task re-attaches to the job while it runs.\n{adapter.log_tail(log_tail)}"
            )
        sleep(poll_s)


def run_lifecycle(
    cluster,
    adapter: JobAdapter,
    *,
    timeout_s: float,
    poll_s: float,
    launcher: LauncherPod | None,
    print_fn: Callable[[str], Any] = print,
    wait: Callable[[], dict] | None = None,
    **wait_options: Any,
) -> tuple[str, dict | None]:
    """The whole lifecycle inside the launcher's SIGTERM guard (a cancel deletes the job, an eviction keeps it):
    (:func:`submit_or_attach`'s outcome, the succeeded job; None when an earlier attempt's job had succeeded).
    ``wait``: the adapter's own wait (default :func:`poll_until_end` with ``wait_options``)."""
    earlier = adapter.job
    group, version, plural, _ = earlier.resource
    guard = delete_on_sigterm(
        cluster, group, version, plural, earlier.name, namespace=earlier.namespace, print_fn=print_fn,
        launcher=launcher,
    )  # fmt: skip
    with guard:
        outcome = submit_or_attach(cluster, adapter, poll_s=poll_s, print_fn=print_fn)
        if outcome == REUSED:
            return outcome, None
        if wait is not None:
            return outcome, wait()
        final = poll_until_end(adapter, timeout_s=timeout_s, poll_s=poll_s, print_fn=print_fn, **wait_options)
        return outcome, final
