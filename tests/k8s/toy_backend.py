"""A toy training backend, whole: the one module a new backend is (issue 48.2), beside its one registry entry
(:data:`TOY_BACKEND`, registered by tests/k8s/test_backends.py). Its job, a ``ToyJob``, says ``Done`` or ``Failed``
in its conditions; a ``BadInput`` failure is permanent. It submits and waits for its job through the shared
lifecycle (llmft/components/lib/jobs/lifecycle.py): re-attaching to an earlier attempt's job, waiting out one
being deleted, recreating a retryable failure, the deadline and the API retries are the lifecycle's, not its own."""

from __future__ import annotations

from llmft.components.lib.cluster import ClusterError
from llmft.components.lib.contracts.run_jobs import JobFailedPermanently, TrainingJobFailed, parse_time
from llmft.components.lib.jobs.backends import OWN_TRIALS, Backend
from llmft.components.lib.jobs.lifecycle import (
    FAILED,
    RUNNING,
    SUCCEEDED,
    ClusterRun,
    EarlierJob,
    JobAdapter,
    run_lifecycle,
)
from llmft.components.lib.jobs.pytorchjob_spec import build_job_spec
from llmft.katib.trial_kinds import JobResource, TrialKind

TOY = JobResource("toy.example.org", "v1", "toyjobs", "ToyJob")
TOY_TRIAL = TrialKind(
    resource=TOY,
    primary_container_name="toy",
    primary_pod_labels={"toy.example.org/role": "leader"},
    success_condition='status.conditions.#(type=="Done")#|#(status=="True")#',
    failure_condition='status.conditions.#(type=="Failed")#|#(status=="True")#',
    container_rule="spec.command must hold the trainer's command",
    find_command=lambda job: job["spec"] if job["spec"].get("command") else None,
)
PERMANENT_REASON = "BadInput"


def toy_body(job, spec) -> dict:
    return {
        "apiVersion": TOY.api_version,
        "kind": TOY.kind,
        "metadata": {"name": spec.name, "labels": dict(spec.labels)},
        "spec": {"image": spec.image, "command": ["llmft", "train"], "overrides": dict(spec.overrides),
                 "activeDeadlineSeconds": job.timeout_s},
    }  # fmt: skip


def toy_trial(job, spec, early_stopping: bool) -> dict:
    body = toy_body(job, spec)
    del body["metadata"]["name"]
    return body


def _true(job: dict, kind: str) -> dict | None:
    conditions = (job.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind and c.get("status") == "True"), None)


class ToyJobAdapter(JobAdapter):
    """The ToyJob as the shared lifecycle drives it: its kind and reads, its phase, what is permanent, how to
    submit it, its deadline clock. Log streaming, Pending reports and the log tail take the lifecycle's defaults."""

    succeeded_word = "Done"

    def __init__(self, cluster, body: dict):
        self.cluster, self.body = cluster, body
        name, namespace = body["metadata"]["name"], cluster.namespace
        self.job = EarlierJob(
            TOY, name, namespace, get=lambda: _get(cluster, name, namespace),
            pods=lambda: cluster.list_pods(f"toy.example.org/job={name}", namespace=namespace),
        )  # fmt: skip

    def phase(self, job: dict) -> str:
        return SUCCEEDED if _true(job, "Done") else FAILED if _true(job, "Failed") else RUNNING

    def raise_if_final(self, job: dict, *, earlier: bool) -> None:
        failed = _true(job, "Failed") or {}
        if failed.get("reason") == PERMANENT_REASON:
            when = " in an earlier attempt of this task" if earlier else ""
            raise JobFailedPermanently(f"{self.job.what} failed permanently{when}: {failed.get('message')}")

    def retryable_failure(self, job: dict) -> Exception:
        return TrainingJobFailed(f"{self.job.what} Failed ({(_true(job, 'Failed') or {}).get('reason')})")

    def submit(self) -> None:
        self.cluster.create_custom_object(*TOY[:3], self.body, namespace=self.job.namespace)

    def started_at(self, job: dict) -> tuple[float | None, float | None]:
        return parse_time((job.get("status") or {}).get("startTime")), job["spec"].get("activeDeadlineSeconds")


def _get(cluster, name: str, namespace: str) -> dict | None:
    try:
        return cluster.get_custom_object(*TOY[:3], name, namespace=namespace)
    except ClusterError as exc:
        if exc.status == 404:
            return None
        raise


def attach_toyjob(run: ClusterRun) -> dict:
    """Submit the plan's ToyJob (or re-attach to it) and wait for it: the shared lifecycle, adapted."""
    adapter = ToyJobAdapter(run.cluster, toy_body(run.job, build_job_spec(run.job, run.launch)))
    outcome, final = run_lifecycle(
        run.cluster, adapter, timeout_s=float(run.job.timeout_s), poll_s=run.poll_s, launcher=run.launcher,
        print_fn=run.print_fn, api_retries=run.api_retries,
    )  # fmt: skip
    return {"name": adapter.job.name, "succeeded": True, "outcome": outcome, "final": final}


TOY_BACKEND = Backend(
    name="toyjob", render_name="toy", resource=TOY, trial_kind=TOY_TRIAL, build=toy_body, trial_job=toy_trial,
    katib_trials=OWN_TRIALS, attach=attach_toyjob,
)  # fmt: skip
"""Its one registry entry: ``register(TOY_BACKEND)``; its Katib trial policy explicit (its own ToyJob trials)."""
