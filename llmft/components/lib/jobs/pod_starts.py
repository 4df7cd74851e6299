"""Pods that never start: the launcher counts them, since nothing else does.

Under ``restartPolicy: ExitCode`` the Training Operator (kubeflow/trainer v1.9.4
``pkg/controller.v1/common/pod.go`` 339-366) reads a Failed pod's exit code from its ``pytorch``
container and, when that container never ran (evicted before it started, a failed init
container, a GPU the kubelet could not admit), uses the magic number ``0xbeef``; 48879 >= 128 is
retryable (``pkg/util/train/train_util.go`` 24-26), so the pod is deleted and recreated, again
and again. The trainer never starts, so its own restart budget (``max_restarts_without_progress``)
never counts these, and ``backoffLimit`` counts only restarts of running containers
(``pkg/core/job.go`` 93-133): only ``activeDeadlineSeconds`` would end the loop.

:class:`StartWatcher` sees every poll's pods of the job: a pod name that comes back with a new uid
while its previous pod was never seen with its container running or terminated is one recreation
without a start. After :data:`NEVER_STARTED_LIMIT` of them with no start in between (no container
ran, so no checkpoint can have been written), the launcher deletes the job and fails the step
with the pods' reasons in one line (:class:`JobNeverStarts`).

A TrainJob has no such loop: its JobSet's Jobs count failed pods, started or not, towards their
``backoffLimit`` (Kubernetes ``pkg/controller/job/job_controller.go``), then the TrainJob Fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmft.trainer.errors import LlmftError, TransientError

NEVER_STARTED_LIMIT = 5
"""Pod recreations in a row without a container start after which the launcher stops the job."""
BEEF = 0xBEEF
"""The exit code the Training Operator gives a pod whose container never ran (pod.go 340)."""


class JobNeverStarts(TransientError):
    """The job's pods were recreated NEVER_STARTED_LIMIT times without their container running (exit 200)."""


STARTED_REASON = "Started"
"""The reason of the kubelet's event when it started a container ("Started container <name>":
kubernetes v1.30 pkg/kubelet/events/event.go StartedContainer, emitted by
pkg/kubelet/kuberuntime/kuberuntime_container.go startContainer)."""


def container_ran(pod, container: str) -> bool:
    """The pod's ``container`` is running or has terminated, now or in its ``lastState`` (a container
    restarted in place ran before): it started at least once."""
    for status in (pod.status.container_statuses or []) if pod.status else []:
        if status.name != container:
            continue
        for state in (status.state, status.last_state):
            if state is not None and (state.running is not None or state.terminated is not None):
                return True
    return False


def started_by_events(events, pod_uid: str, container: str) -> bool:
    """The kubelet reported starting ``container`` in the pod ``pod_uid`` (a pod seen only Pending
    may have run and crashed, OOMKilled while loading, between two polls: its events still say so
    after the operator replaced it; an event without a uid counts)."""
    for event in events:
        involved = event.involved_object
        if event.reason != STARTED_REASON or container not in (event.message or ""):
            continue
        if involved is None or not involved.uid or involved.uid == pod_uid:
            return True
    return False


def failure_reason(pod) -> str:
    """Why a pod is failing before its container runs: the pod's reason and message, a failed init
    container, or a waiting reason; "" when nothing says."""
    status = pod.status
    if status is None:
        return ""
    found = [f"{status.reason}: {status.message or ''}".strip(": ")] if status.reason or status.message else []
    for init in status.init_container_statuses or []:
        done = init.state.terminated if init.state else None
        if done is not None and done.exit_code:
            found.append(f"init container {init.name} exited {done.exit_code} ({done.reason or 'Error'})")
    for container in status.container_statuses or []:
        waiting = container.state.waiting if container.state else None
        if waiting is not None and waiting.reason not in (None, "ContainerCreating", "PodInitializing"):
            found.append(f"{waiting.reason}: {waiting.message or ''}".strip(": "))
    return "; ".join(found)


@dataclass
class StartWatcher:
    """Called with each poll's pods; raises :class:`JobNeverStarts` at ``limit`` recreations without a start."""

    what: str
    container: str
    limit: int = NEVER_STARTED_LIMIT
    events: Callable[[str], list] | None = None  # pod name -> its events (Cluster.list_events)
    seen: dict = field(default_factory=dict)  # pod name -> [uid, ran, reason]
    reasons: list = field(default_factory=list)

    def __call__(self, pods) -> None:
        for pod in pods:
            name, uid, ran = pod.metadata.name, pod.metadata.uid, container_ran(pod, self.container)
            previous = self.seen.get(name)
            if previous is not None and previous[0] != uid and not previous[1]:
                previous[1] = self._ran_unseen(name, previous[0])
                if previous[1]:
                    self.reasons = []  # it ran (and may have checkpointed): the count restarts
                else:
                    self.reasons.append(f"{name}: {previous[2] or f'failed before its container ran (exit {BEEF})'}")
            if ran:
                self.reasons = []
            if previous is None or previous[0] != uid:
                previous = self.seen[name] = [uid, False, ""]
            previous[1] = previous[1] or ran
            previous[2] = failure_reason(pod) or previous[2]
        if self.limit and len(self.reasons) >= self.limit:
            last = "; ".join(dict.fromkeys(self.reasons[-3:]))
            raise JobNeverStarts(
                f"{self.what}: its pods were recreated {len(self.reasons)} times without their container ever "
                f"running (Training Operator exit code {BEEF}: evicted before start, init container failed, GPU "
                f"not admitted); stopped it instead of looping until activeDeadlineSeconds. Last reasons: {last}"
            )

    def _ran_unseen(self, name: str, uid: str) -> bool:
        """The replaced pod ``uid`` ran between two polls, as its events tell (none read: it did not)."""
        if self.events is None:
            return False
        try:
            return started_by_events(self.events(name), uid, self.container)
        except LlmftError:  # ClusterError: the API did not answer; count it as not started
            return False
