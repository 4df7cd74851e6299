"""What every cluster backend does with the job an earlier attempt of the train task left under the same name, in
one place (issue 48.2): the PyTorchJob and TrainJob launchers adapt it with their kind, their API reads and their
pods.

* :func:`settle_earlier_attempt`: a job of an earlier attempt that is being deleted (a cancel's SIGTERM, the exit
  handler or the janitor: foreground, so it stays until its pods committed their SIGTERM checkpoint), or the pods
  of one deleted in the background that still stop, are waited out before anything is decided;
* :func:`delete_and_wait`: a Failed job is deleted with foreground propagation and waited out before it is
  recreated under the same name (:func:`llmft.components.lib.cluster.wait_until_gone` says why).

Still per backend (the rest of item 2): the wait itself (the PyTorchJob's own poll loop, the TrainJob's SDK
``wait_for_job_status``), the budget, permanent-failure detection and the log tail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmft.components.lib.cluster import RECREATE_WAIT_S, ClusterError, wait_until_gone
from llmft.katib.trial_kinds import JobResource


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
