"""Run the trainer's TrainJob: submit (or re-attach), watch, fail with the failing node's log tail.

Submitted and watched the way the Kubeflow SDK does it: the body is the SDK's own model
(``kubeflow_trainer_api``, built in trainjob_spec.py) sent with ``create_namespaced_custom_object``,
as ``KubernetesBackend.train`` does; the wait is the SDK's ``wait_for_job_status`` (TrainJob
status from the ``Complete`` / ``Failed`` conditions) and ``get_runtime``/``delete_job``, all on
:class:`SdkBackend`, the SDK's ``KubernetesBackend`` whose API objects are the project's
:class:`~llmft.components.lib.cluster.Cluster` (one configuration; one fake in tests). The SDK's
``TrainerClient.train`` cannot carry this job (docs/trainer-v2.md says why).

Failures and restarts (kubeflow/trainer v2.3.0 and JobSet v0.12.0). The ``torch-distributed``
runtime sets no JobSet ``failurePolicy`` and no Job ``backoffLimit``; JobSet defaults the pods'
``restartPolicy`` to OnFailure (jobset ``pkg/webhooks/jobset_webhook.go`` 124-126). So any
non-zero exit restarts the ``node`` container in place until the Job's backoffLimit (Kubernetes'
default 6), then the Job fails, the JobSet fails with reason ``FailedJobs`` (no failure policy:
``pkg/controllers/failure_policy.go`` 52-61) and the TrainJob copies that as its ``Failed``
condition (trainer ``pkg/runtime/framework/plugins/jobset/jobset.go`` 450-457; an expired
``activeDeadlineSeconds`` gives ``Failed``/``DeadlineExceeded``, ``pkg/controller/trainjob_controller.go``
155-182). The PyTorchJob path's ExitCode semantics (errors.py: 1-127 permanent, 128-255 retried)
are therefore applied by this launcher while it watches: a ``node`` container that exited 1-127
(bad config or data: it would fail the same way six more times) ends the wait at once: the
TrainJob is suspended (its pods, and GPUs, are released; the object stays, annotated with the exit,
so a retried task fails the same way instead of recreating it) and the step fails with that
node's log (``JobFailedPermanently``, exit 1). 128-255 (143 preempted, 130, 137, 200 transient) are
left to the in-place restart, which resumes from the newest checkpoint, and reported with the
restart count. ``DeadlineExceeded`` and a wait that outlives ``timeout_s`` are ``JobTimedOut``
(exit 200), as on the PyTorchJob path (llmft/components/lib/jobs/pytorchjob_launch.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.cluster import Cluster, ClusterError
from llmft.components.lib.contracts.run_jobs import JobFailedPermanently, JobTimedOut, TrainingJobFailed, parse_time
from llmft.components.lib.jobs import lifecycle
from llmft.components.lib.jobs.launcher_pod import delete_on_sigterm
from llmft.components.lib.jobs.lifecycle import ClusterRun, EarlierJob, JobAdapter
from llmft.components.lib.jobs.pytorchjob_logs import newest_progress_only
from llmft.components.lib.jobs.pytorchjob_spec import build_job_spec
from llmft.components.lib.jobs.trainjob_runtime import check_runtime, sdk_backend
from llmft.components.lib.jobs.trainjob_spec import (
    GROUP,
    PLURAL,
    RESOURCE,
    TRAINER_CONTAINER,
    TRAINER_JOB,
    VERSION,
    build_trainjob,
    parse_runtime_ref,
    trainjob_to_dict,
)
from llmft.trainer.errors import TransientError

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
"""Pod label naming the JobSet (= the TrainJob's name); the SDK's POD_LABEL_SELECTOR uses it."""
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
NODE_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
"""The node's rank (Indexed Job completion index): PET_NODE_RANK comes from it (torch.go 152-156)."""
COMPLETE, FAILED = "Complete", "Failed"
PERMANENT_EXIT_ANNOTATION = "kfp-llm-finetune/permanent-exit"
"""Set on a TrainJob suspended after a permanent exit: a retried task reads it and does not recreate it."""
DEADLINE_REASON = "DeadlineExceeded"
"""The Failed reason of an expired activeDeadlineSeconds (trainer ``trainjob_types.go`` 80-83)."""
EXIT_MEANINGS = {
    1: "bad input or config (never retried)",
    2: "usage error",
    130: "interrupted (SIGINT)",
    137: "killed (SIGKILL, often OOMKilled)",
    143: "preempted (SIGTERM): checkpoint committed, resuming",
    200: "transient fault (I/O, full disk, unreachable server): retrying",
}


class TrainJobFailed(TrainingJobFailed):
    """The TrainJob Failed (not permanently, not by its deadline): a retry recreates it; the message
    carries the failing node's log tail."""


class PermanentExit(Exception):
    """A trainer node exited 1-127: raised from the wait's callback to end it at once."""

    def __init__(self, pod: str, code: int):
        super().__init__(f"pod {pod} exited {code}")
        self.pod, self.code = pod, code


def is_permanent(code: int) -> bool:
    """ExitCode semantics (Training Operator ``pkg/util/train/train_util.go``): 1-127 permanent."""
    return 1 <= code <= 127


def node_pods(cluster: Cluster, name: str, namespace: str) -> list:
    return cluster.list_pods(f"{JOBSET_NAME_LABEL}={name},{REPLICATED_JOB_LABEL}={TRAINER_JOB}", namespace=namespace)


def _node_status(pod) -> Any:
    statuses = (pod.status.container_statuses if pod.status else None) or []
    return next((s for s in statuses if s.name == TRAINER_CONTAINER), None)


def _terminated_codes(status) -> list[int]:
    """Exit codes of the current and the previous run of the container (newest first)."""
    codes = []
    for state in (status.state, status.last_state):
        terminated = getattr(state, "terminated", None) if state is not None else None
        if terminated is not None and terminated.exit_code:
            codes.append(int(terminated.exit_code))
    return codes


def _pod_log(cluster: Cluster, pod: str, namespace: str, lines: int | None = None, previous: bool = False) -> str:
    kwargs: dict[str, Any] = {"container": TRAINER_CONTAINER, "previous": previous}
    if lines is not None:
        kwargs["tail_lines"] = lines
    return cluster.core_api.read_namespaced_pod_log(name=pod, namespace=namespace, **kwargs) or ""


class NodeWatcher:
    """The wait's callback: prints node 0's new log lines, reports restarts, and raises
    :class:`PermanentExit` when any node's container exited 1-127."""

    def __init__(self, cluster: Cluster, name: str, namespace: str, print_fn: Callable[[str], Any] = print):
        self.cluster, self.name, self.namespace, self.print_fn = cluster, name, namespace, print_fn
        self.lines_seen: dict[str, int] = {}
        self.restarts_seen: dict[str, int] = {}

    def __call__(self, trainjob: Any = None) -> None:
        try:
            pods = node_pods(self.cluster, self.name, self.namespace)
        except ClusterError:
            return
        for pod in pods:
            status = _node_status(pod)
            if status is None:
                continue
            self._report_restart(pod.metadata.name, status)
            permanent = [c for c in _terminated_codes(status) if is_permanent(c)]
            if permanent:
                raise PermanentExit(pod.metadata.name, permanent[0])
            if (pod.metadata.labels or {}).get(NODE_INDEX_LABEL) == "0" and status.state.running is not None:
                self._follow(pod.metadata.name)

    def _report_restart(self, pod: str, status) -> None:
        count = status.restart_count or 0
        if count > self.restarts_seen.get(pod, 0):
            code = (_terminated_codes(status) or [0])[-1]
            meaning = EXIT_MEANINGS.get(code, "retried")
            self.print_fn(f"[{pod}] container restarted ({count} so far): previous run exited {code}, {meaning}")
            self.restarts_seen[pod] = count

    def _follow(self, pod: str) -> None:
        try:
            lines = _pod_log(self.cluster, pod, self.namespace).splitlines()
        except Exception:  # noqa: BLE001 - not started yet / restarting: the next poll reads it
            return
        start = self.lines_seen.get(pod, 0)
        start = 0 if len(lines) < start else start  # the container restarted: a fresh log
        for line in newest_progress_only(lines[start:]):  # one progress line per poll, as for a PyTorchJob
            self.print_fn(f"[{pod}] {line}")
        self.lines_seen[pod] = len(lines)


def log_tail(cluster: Cluster, name: str, namespace: str, lines: int = 50) -> str:
    """The last ``lines`` lines of the failing node (the first with a non-zero exit; else node 0),
    from its previous run when the container has restarted since."""
    try:
        pods = node_pods(cluster, name, namespace)
    except ClusterError as exc:
        return f"(the node pods could not be listed: {exc})"
    if not pods:
        return f"(no node pod: the TrainJob never started one; check `kubectl describe trainjob {name}`)"
    failing = [p for p in pods if _node_status(p) is not None and _terminated_codes(_node_status(p))]
    by_index = sorted(pods, key=lambda p: (p.metadata.labels or {}).get(NODE_INDEX_LABEL, ""))
    pod = (failing or by_index)[0]
    status = _node_status(pod)
    previous = bool(status is not None and status.state.terminated is None and status.last_state.terminated)
    try:
        text = _pod_log(cluster, pod.metadata.name, namespace, lines, previous=previous)
    except Exception as exc:  # noqa: BLE001 - the failure report must not fail itself
        return f"(the log of pod {pod.metadata.name} could not be read: {exc})"
    tail = text.splitlines()[-lines:]
    which = "previous run of " if previous else ""
    return f"last {len(tail)} log lines of {which}pod {pod.metadata.name}:\n" + "\n".join(f"  {t}" for t in tail)


def terminal_condition(job: dict) -> dict | None:
    """The TrainJob's ``Complete`` or ``Failed`` condition with status True, or None while it runs."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") in (COMPLETE, FAILED) and condition.get("status") == "True":
            return condition
    return None


def get_trainjob(cluster: Cluster, name: str, namespace: str) -> dict | None:
    try:
        return cluster.get_custom_object(GROUP, VERSION, PLURAL, name, namespace=namespace)
    except ClusterError as exc:
        if exc.status == 404:
            return None
        raise


class TrainJobAdapter(JobAdapter):
    """The TrainJob ``name`` as the shared lifecycle (llmft/components/lib/jobs/lifecycle.py) drives it: its
    ``Complete``/``Failed`` conditions, its node pods, a permanent failure (a node exited 1-127, recorded on the
    TrainJob once this launcher suspended it; or ``DeadlineExceeded``) and the failing node's log. Its wait is
    the SDK's ``wait_for_job_status`` (:func:`run_trainjob`), on the lifecycle's budget."""

    succeeded_word = COMPLETE

    def __init__(self, cluster: Cluster, name: str, namespace: str, body: dict):
        self.cluster, self.name, self.namespace, self.body = cluster, name, namespace, body
        self.job = EarlierJob(
            RESOURCE,
            name,
            namespace,
            get=lambda: get_trainjob(cluster, name, namespace),
            pods=lambda: node_pods(cluster, name, namespace),
            pods_word="node pods",
        )

    def phase(self, job: dict) -> str:
        condition = terminal_condition(job)
        if _recorded_exit(job) or (condition is not None and condition["type"] == FAILED):
            return lifecycle.FAILED  # suspended by this launcher after a permanent exit, or Failed
        return lifecycle.SUCCEEDED if condition is not None else lifecycle.RUNNING

    def started_at(self, job: dict) -> tuple[float | None, float | None]:
        return deadline_clock(job)

    def raise_if_final(self, job: dict, *, earlier: bool, lines: int = 50) -> None:
        """JobFailedPermanently for the exit recorded on a TrainJob this launcher suspended or a node that exited
        1-127, JobTimedOut when ``DeadlineExceeded`` ended it; otherwise return (a retry may recreate it)."""
        name, namespace = self.name, self.namespace
        when = " in an earlier attempt of this task" if earlier else ""
        if recorded := _recorded_exit(job):
            raise _permanent(namespace, name, recorded, when, "")
        if (terminal_condition(job) or {}).get("reason") == DEADLINE_REASON:
            raise JobTimedOut(
                f"TrainJob {namespace}/{name} ran into its activeDeadlineSeconds{when}: a timeout, not a training "
                f"failure. Raise job_timeout_s, or re-run the pipeline (the run directory keeps its checkpoints).\n"
                f"{self.log_tail(lines)}"
            )
        try:
            pods = node_pods(self.cluster, name, namespace)
        except ClusterError:
            return
        for pod in pods:
            status = _node_status(pod)
            codes = [c for c in (_terminated_codes(status) if status is not None else []) if is_permanent(c)]
            if codes:
                exit_ = f"pod {pod.metadata.name} exited {codes[0]}"
                raise _permanent(namespace, name, exit_, when, self.log_tail(lines))

    def retryable_failure(self, job: dict, lines: int = 50) -> Exception:
        condition = terminal_condition(job) or {}
        reason = f"{condition.get('reason') or FAILED}: {condition.get('message') or ''}".strip()
        return TrainJobFailed(
            f"TrainJob {self.namespace}/{self.name} Failed ({reason}); a retry of this task recreates it and resumes "
            f"from the newest checkpoint.\n{self.log_tail(lines)}"
        )

    def submit(self) -> None:
        self.cluster.create_custom_object(GROUP, VERSION, PLURAL, self.body, namespace=self.namespace)

    def log_tail(self, lines: int) -> str:
        return log_tail(self.cluster, self.name, self.namespace, lines)


def deadline_clock(job: dict) -> tuple[float | None, float | None]:
    """(creationTimestamp, activeDeadlineSeconds): the controller counts the deadline from the TrainJob's
    creation (trainjob_controller.go 155-167)."""
    created = parse_time((job.get("metadata") or {}).get("creationTimestamp"))
    return created, (job.get("spec") or {}).get("activeDeadlineSeconds")


def _recorded_exit(job: dict) -> str:
    """The permanent exit this launcher recorded on the TrainJob it suspended ("" when none)."""
    return ((job.get("metadata") or {}).get("annotations") or {}).get(PERMANENT_EXIT_ANNOTATION) or ""


def _permanent(namespace: str, name: str, what: str, when: str, tail: str, action: str = "") -> Exception:

    found = re.search(r"exited (\d+)", what)
    code = int(found.group(1)) if found else 1
    meaning = EXIT_MEANINGS.get(code, "a permanent failure: exit codes 1-127 are never retried")
    return JobFailedPermanently(
        f"TrainJob {namespace}/{name} failed permanently{when}: {what} ({meaning}).{action} It is not recreated: "
        f"fix the cause, delete the TrainJob, then re-run the pipeline.\n{tail}".rstrip()
    )


def stop_permanently(cluster: Cluster, name: str, namespace: str, what: str) -> None:
    """Suspend the TrainJob (its JobSet's pods go: no more restarts, GPUs released) and record why."""
    patch = {"metadata": {"annotations": {PERMANENT_EXIT_ANNOTATION: what}}, "spec": {"suspend": True}}
    cluster.patch_custom_object(GROUP, VERSION, PLURAL, name, patch, namespace=namespace)


def wait_budget(job: dict, timeout_s: float, now: float) -> float:
    """Seconds to wait for ``job``: ``timeout_s``, cut for a job created by an earlier attempt to its own
    deadline (the shared :func:`~llmft.components.lib.jobs.lifecycle.job_deadline`: creation +
    activeDeadlineSeconds, the controller's clock, plus the launcher's grace), so a re-attached wait never
    outlives the train task."""
    until = lifecycle.job_deadline(deadline_clock(job), timeout_s, now)
    return max(1.0, min(timeout_s, until - now))


def run_trainjob(
    cluster: Cluster,
    job: Any,
    *,
    timeout_s: float,
    poll_s: float = 30.0,
    log_tail_lines: int = 50,
    print_fn: Callable[[str], Any] = print,
    clock: Callable[[], float] = time.time,
    owner: dict | None = None,
) -> dict:
    """Submit ``job`` (a ``TrainerV1alpha1TrainJob``) or re-attach to it, stream node 0's log while the
    SDK waits for ``Complete``/``Failed``, and return a summary once Complete. A node exiting 1-127 ->
    ``JobFailedPermanently`` (the job is suspended); Failed by the deadline or no end within
    ``timeout_s`` -> ``JobTimedOut`` (the job keeps running until its activeDeadlineSeconds); Failed
    otherwise -> :class:`TrainJobFailed`; each with the failing node's log tail. ``clock``: the wall clock
    (seconds since the epoch) the job's ``creationTimestamp`` is compared with, unless a test injects its own.
    ``owner``: the ownerReference a created TrainJob gets (the run's Workflow, as a PyTorchJob's: cleanup.py)."""

    if poll_s <= 0 or timeout_s <= poll_s:
        raise ValueError(f"need 0 < poll_s ({poll_s}) < timeout_s ({timeout_s})")
    body = trainjob_to_dict(job)
    name = body["metadata"]["name"]
    namespace = body["metadata"].get("namespace") or cluster.namespace
    body["metadata"]["namespace"] = namespace
    if owner:
        body["metadata"]["ownerReferences"] = [owner]
    backend = sdk_backend(cluster, namespace)
    ref = body["spec"]["runtimeRef"]
    check_runtime(backend, *parse_runtime_ref(f"{ref.get('kind', 'ClusterTrainingRuntime')}/{ref['name']}"))
    adapter = TrainJobAdapter(cluster, name, namespace, body)
    outcome = lifecycle.submit_or_attach(cluster, adapter, poll_s=poll_s, print_fn=print_fn)
    if outcome == lifecycle.REUSED:
        return {"name": name, "namespace": namespace, "succeeded": True, "reused": True}
    print_fn(f"{outcome} TrainJob {namespace}/{name} (runtime {ref['name']}); waiting up to {timeout_s:.0f}s")
    watcher = NodeWatcher(cluster, name, namespace, print_fn)
    budget = wait_budget(get_trainjob(cluster, name, namespace) or body, timeout_s, clock())
    try:
        final = backend.wait_for_job_status(
            name,
            status={COMPLETE, FAILED},
            timeout=max(budget, 2 * poll_s),
            polling_interval=poll_s,
            callbacks=[watcher],
        )
    except PermanentExit as exc:
        tail = log_tail(cluster, name, namespace, log_tail_lines)
        stop_permanently(cluster, name, namespace, str(exc))
        action = " Suspended it (pods released) instead of letting its Job restart it up to the backoffLimit."
        raise _permanent(namespace, name, str(exc), "", tail, action) from None
    except TimeoutError as exc:
        if exc.__cause__ is not None:  # an API read that did not answer (backend.py 199-202, 437-440), not the wait
            raise TransientError(f"TrainJob {namespace}/{name}: the Kubernetes API did not answer: {exc}") from None
        raise JobTimedOut(
            f"TrainJob {namespace}/{name} did not finish within {timeout_s:.0f}s; it keeps running until its "
            f"activeDeadlineSeconds.\n{log_tail(cluster, name, namespace, log_tail_lines)}"
        ) from exc
    watcher(final)
    current = get_trainjob(cluster, name, namespace) or {}
    condition = terminal_condition(current) or {}
    if final.status == FAILED:
        adapter.raise_if_final(current, earlier=False, lines=log_tail_lines)
        raise adapter.retryable_failure(current, lines=log_tail_lines)
    return {
        "name": name,
        "namespace": namespace,
        "succeeded": True,
        "conditions": (current.get("status") or {}).get("conditions") or [],
        "completion_time": condition.get("lastTransitionTime"),
    }


def run_trainjob_on_cluster(
    job,
    launch,
    *,
    poll_s: float = 30.0,
    cluster=None,
    owner: dict | None = None,
    print_fn: Callable[[str], Any] = print,
) -> dict:
    """The train step's ``trainjob`` backend: the plan's JobPlan -> TrainJob on ``job.runtime``, run
    (``owner``: its ownerReference, the run's Workflow)."""

    trainjob = build_trainjob(build_job_spec(job, launch), runtime=job.runtime)
    cluster = cluster or cluster_module.Cluster()
    return run_trainjob(
        cluster, trainjob, timeout_s=float(job.timeout_s), poll_s=poll_s, owner=owner, print_fn=print_fn
    )


def attach_trainjob(run: ClusterRun) -> dict:
    """The trainjob backend's attach (llmft/components/lib/jobs/backends.py): :func:`run_trainjob_on_cluster`,
    its TrainJob deleted on a cancel's SIGTERM (llmft/components/lib/jobs/launcher_pod.py). ``run.api_retries``
    and ``run.pending_every`` are the shared poll loop's; the SDK's wait reads the job and its pods itself."""
    guard = delete_on_sigterm(
        run.cluster, GROUP, VERSION, PLURAL, run.job.name, print_fn=run.print_fn, launcher=run.launcher
    )
    with guard:
        return run_trainjob_on_cluster(
            run.job, run.launch, poll_s=run.poll_s, cluster=run.cluster, owner=run.owner, print_fn=run.print_fn
        )
