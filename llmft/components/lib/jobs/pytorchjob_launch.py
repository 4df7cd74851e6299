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
from llmft.components.lib.contracts.run_jobs import JobFailedPermanently, JobTimedOut, TrainingJobFailed, parse_time
from llmft.components.lib.jobs import pod_starts
from llmft.components.lib.jobs.launcher_pod import LauncherPod, read_launcher_pod
from llmft.components.lib.jobs.lifecycle import (
    API_RETRIES,
    ATTACHED,
    FAILED,
    PENDING_EVERY,
    RUNNING,
    SUCCEEDED,
    ClusterRun,
    EarlierJob,
    poll_until_end,
    run_lifecycle,
)
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

DEADLINE_MESSAGE = "active longer than specified deadline"
"""What the operator writes into the Failed condition when activeDeadlineSeconds ends a job
(kubeflow/trainer v1.9.4 pkg/controller.v1/common/job.go 212)."""


# --- the pytorchjob backend's attach (llmft/components/lib/jobs/backends.py runs it) --------------------


def attach_pytorchjob(run: ClusterRun) -> dict:
    """The plan's job (``run.job``, a JobPlan) as a PyTorchJob running ``run.launch`` (a TrainerLaunch):
    submitted, or re-attached to, and waited for (see :func:`run_job`)."""
    return run_job(
        run.cluster,
        build_job_spec(run.job, run.launch),
        timeout_s=float(run.job.timeout_s),
        poll_s=run.poll_s,
        print_fn=run.print_fn,
        api_retries=run.api_retries,
        pending_every=run.pending_every,
        owner=run.owner,
        launcher=run.launcher,
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
    """Submit the PyTorchJob of ``spec`` (a JobSpec), or re-attach to it, and wait for its end through the shared
    lifecycle (llmft/components/lib/jobs/lifecycle.py; the module docstring lists the rules). SIGTERM deletes it
    on a cancel. ``launcher``: this pod as read before training (default: read now); ``owner``: the job's
    ownerReference (default: the run's Argo Workflow when in a KFP pod, else none). ``clock`` (seconds since the
    epoch, compared with the job's ``startTime``) and ``sleep`` are the wall clock unless a test injects its own."""

    if poll_s <= 0 or timeout_s < poll_s:
        raise ValueError(f"need 0 < poll_s ({poll_s}) <= timeout_s ({timeout_s})")
    launcher = launcher if launcher is not None else read_launcher_pod(cluster, print_fn=print_fn)
    owner = owner if owner is not None else launcher.owner_reference()
    adapter = PyTorchJobAdapter(
        cluster, spec.name, cluster.namespace, spec=spec, owner=owner, print_fn=print_fn, api_retries=api_retries,
        pending_every=pending_every,
    )  # fmt: skip
    outcome, final = run_lifecycle(
        cluster, adapter, timeout_s=timeout_s, poll_s=poll_s, launcher=launcher, print_fn=print_fn,
        api_retries=api_retries, clock=clock, sleep=sleep,
    )  # fmt: skip
    summary = {"name": spec.name, "namespace": cluster.namespace, "succeeded": True}
    if final is None:
        return {**summary, "reused": True}
    status = final.get("status") or {}
    return {
        **summary,
        "reattached": outcome == ATTACHED,
        "conditions": _conditions(final),
        "start_time": status.get("startTime"),
        "completion_time": status.get("completionTime"),
    }


class PyTorchJobAdapter:
    """The PyTorchJob ``name`` as the shared lifecycle (llmft/components/lib/jobs/lifecycle.py) drives it: its
    conditions (``Succeeded``/``Failed``), its pods by the operator's job-name label, a permanent failure (a
    replica exited 1-127 under ExitCode, or activeDeadlineSeconds) and the master's log."""

    succeeded_word = "Succeeded"

    def __init__(self, cluster, name: str, namespace: str, *, spec=None, owner: dict | None = None,
                 print_fn: Callable[[str], Any] = print, api_retries: int = API_RETRIES,
                 pending_every: int = PENDING_EVERY, log_tail: int = 50):  # fmt: skip
        self.cluster, self.name, self.namespace, self.spec, self.owner = cluster, name, namespace, spec, owner
        self.print_fn, self.lines = print_fn, log_tail
        self.job = EarlierJob(
            RESOURCE,
            name,
            namespace,
            get=lambda: _get_job(cluster, name, namespace, api_retries, print_fn),
            pods=lambda: _job_pods(cluster, name, namespace),
        )
        self.follow = MasterLogFollower(cluster, name, namespace, print_fn)
        self.pending = PendingReporter(cluster, f"{JOB_NAME_LABEL}={name}", namespace, every=pending_every,
                                       print_fn=print_fn)  # fmt: skip
        self.starts = _start_watcher(f"PyTorchJob {namespace}/{name}",
                                     lambda pod: cluster.list_events(pod, namespace=namespace))  # fmt: skip

    def read(self) -> dict | None:
        return _get_job(self.cluster, self.name, self.namespace, 1, self.print_fn)

    def phase(self, job: dict) -> str:
        if _condition(job, "Succeeded"):
            return SUCCEEDED
        return FAILED if _condition(job, "Failed") else RUNNING

    def started_at(self, job: dict) -> tuple[float | None, float | None]:
        """The operator counts activeDeadlineSeconds from ``status.startTime`` (pkg/core/job.go 81-91)."""
        deadline = ((job.get("spec") or {}).get("runPolicy") or {}).get("activeDeadlineSeconds")
        return parse_time((job.get("status") or {}).get("startTime")), deadline

    def raise_if_final(self, job: dict, *, earlier: bool) -> None:
        why, when = _failed_why(job), " in an earlier attempt of this task" if earlier else ""
        if DEADLINE_MESSAGE in why:
            raise JobTimedOut(
                f"PyTorchJob {self.namespace}/{self.name} ran into its activeDeadlineSeconds{when} ({why}): a "
                f"timeout, not a training failure. Raise job_timeout_s, or resume by re-running the pipeline (the run "
                f"directory keeps its checkpoints).\n{self.log_tail(self.lines)}"
            )
        exit_ = permanent_exit(self.cluster, self.name, self.namespace)
        if exit_ is not None:
            pod, code = exit_
            meaning = EXIT_CODE_MEANINGS.get(code, "a permanent failure: exit codes 1-127 are never retried")
            raise JobFailedPermanently(
                f"PyTorchJob {self.namespace}/{self.name} failed permanently{when}: pod {pod} exited {code} "
                f"({meaning}). It is not recreated: fix the cause, then re-run the pipeline.\n"
                f"{pod_log_tail(self.cluster, pod, self.namespace, self.lines)}"
            )

    def retryable_failure(self, job: dict) -> Exception:
        return TrainingJobFailed(
            f"PyTorchJob {self.namespace}/{self.name} Failed ({_failed_why(job)}); a retry of this task recreates it "
            f"and resumes from the newest checkpoint.\n{self.log_tail(self.lines)}"
        )

    def submit(self) -> None:
        _submit(self.cluster, self.spec, self.owner, self.print_fn)

    def while_running(self, job: dict) -> None:
        """Count pods that never start (then delete the job and raise), explain Pending ones."""
        try:
            self.starts(_job_pods(self.cluster, self.name, self.namespace))
        except ClusterError:
            pass  # the next poll reads them
        except JobNeverStarts:
            self.cluster.delete_custom_object(
                GROUP, VERSION, PLURAL, self.name, namespace=self.namespace, propagation="Foreground"
            )
            raise
        self.pending()

    def log_tail(self, lines: int) -> str:
        """The master's last ``lines`` log lines."""
        return _master_tail(self.cluster, self.name, self.namespace, lines)


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


def _failed_why(job: dict) -> str:
    failed = _condition(job, "Failed") or {}
    return f"{failed.get('reason') or 'Failed'}: {failed.get('message') or ''}".strip()


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


# --- waiting ------------------------------------------------------------------------------------


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
    """Wait for a PyTorchJob already submitted (a Katib trial's, a test's): the shared lifecycle's
    :func:`~llmft.components.lib.jobs.lifecycle.poll_until_end` on its adapter."""
    adapter = PyTorchJobAdapter(
        cluster, name, namespace, print_fn=print_fn, api_retries=api_retries, pending_every=pending_every,
        log_tail=log_tail,
    )  # fmt: skip
    return poll_until_end(
        adapter, timeout_s=timeout_s, poll_s=poll_s, print_fn=print_fn, api_retries=api_retries, log_tail=log_tail,
        clock=clock, sleep=sleep,
    )  # fmt: skip


def _start_watcher(what: str, events: Callable[[str], list] | None = None):
    """A StartWatcher (llmft/components/lib/jobs/pod_starts.py) for the ``pytorch`` containers of a job; ``events``
    (pod name -> its events) tells whether a pod replaced between two polls had started."""

    return pod_starts.StartWatcher(what, PYTORCHJOB_CONTAINER, limit=pod_starts.NEVER_STARTED_LIMIT, events=events)


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
