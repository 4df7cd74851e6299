"""run_trainjob through the Kubeflow SDK's KubernetesBackend, against fakes at the kubernetes-client
boundary and a scripted Trainer controller whose pods are built from the submitted TrainJob and the
shipped torch-distributed runtime (trainer_v2_sim.py): Complete, Failed, permanent and retryable
exits, re-attach on retry, timeout, runtime checks, cleanup by label."""

from __future__ import annotations

import dataclasses

import pytest
from fake_clock import FakeClock, rfc3339_now
from kubernetes import client
from trainer_v2_sim import (
    FakeTrainerCoreApi,
    FakeTrainerCustomApi,
    build_jobset,
    load_runtime,
    make_plan,
    node_pods,
)

from llmft.components.lib.cluster import Cluster
from llmft.components.lib.contracts.run_jobs import JobFailedPermanently, JobTimedOut
from llmft.components.lib.jobs.backends import run_on_cluster
from llmft.components.lib.jobs.pytorchjob_spec import build_job_spec
from llmft.components.lib.jobs.trainjob_launch import (
    PERMANENT_EXIT_ANNOTATION,
    TrainJobFailed,
    run_trainjob,
)
from llmft.components.lib.jobs.trainjob_spec import GROUP, PLURAL, VERSION, build_trainjob, trainjob_to_dict
from llmft.trainer.errors import ConfigError

NS = "team-a"
DATA = "/data/tokenized/0123abcd"


class TrainerSim:
    """The cluster: ClusterTrainingRuntimes from ../shared/k8s-crds, and a controller that runs one
    scripted step on each GET of the TrainJob (the SDK's wait polls with GETs)."""

    def __init__(self, crd_dir, runtimes=("torch_distributed", "deepspeed_distributed")):
        objects = {}
        for file_name in runtimes:
            runtime = load_runtime(crd_dir, file_name)
            objects[("clustertrainingruntimes", runtime["metadata"]["name"])] = runtime
        self.custom = FakeTrainerCustomApi(objects, on_get=self._on_get)
        self.core = FakeTrainerCoreApi()
        self.cluster = Cluster(NS, custom_api=self.custom, core_api=self.core)
        self.steps: list = []
        self.pods: list[str] = []

    def script(self, *steps) -> None:
        self.steps = list(steps)

    def _on_get(self, obj: dict, count: int) -> None:
        if obj.get("kind") == "TrainJob" and self.steps:
            self.steps.pop(0)(self, obj)

    def node(self, index: int):
        return self.core.pod(NS, self.pods[index])

    def set_state(self, index: int, state, last_state=None, restarts: int = 0) -> None:
        pod = self.node(index)
        pod.status.container_statuses = [
            client.V1ContainerStatus(
                name="node",
                ready=state.running is not None,
                restart_count=restarts,
                image="trainer",
                image_id="",
                state=state,
                last_state=last_state or client.V1ContainerState(),
            )
        ]


RUNNING = client.V1ContainerState(running=client.V1ContainerStateRunning())


def terminated(code: int) -> client.V1ContainerState:
    return client.V1ContainerState(terminated=client.V1ContainerStateTerminated(exit_code=code))


def start(sim: TrainerSim, job: dict) -> None:
    runtime = sim.custom.cluster_objects[("clustertrainingruntimes", job["spec"]["runtimeRef"]["name"])]
    for pod in node_pods(build_jobset(runtime, job), job["metadata"]["name"], NS):
        sim.core.add_full_pod(pod)
        sim.pods.append(pod["metadata"]["name"])
    for index in range(len(sim.pods)):
        sim.set_state(index, RUNNING)


def seen(sim: TrainerSim, job: dict) -> None:
    """A GET that changes nothing."""


def log(index: int, text: str):
    return lambda sim, job: sim.core.append_log(NS, sim.pods[index], text)


def restart(index: int, code: int, last_words: str):
    """The node's container exited ``code`` and kubelet restarted it in place (restartPolicy OnFailure)."""

    def step(sim, job):
        key = (NS, sim.pods[index])
        sim.core.previous_logs[key] = sim.core.logs[key] + last_words
        sim.core.logs[key] = ""
        sim.set_state(index, RUNNING, last_state=terminated(code), restarts=1)

    return step


def crash(index: int, code: int, last_words: str):
    """The node's container exited ``code`` and waits in CrashLoopBackOff before its next restart."""

    def step(sim, job):
        key = (NS, sim.pods[index])
        sim.core.previous_logs[key] = sim.core.logs[key] + last_words
        sim.core.set_phase(NS, sim.pods[index], "Pending")  # the current container has no log
        waiting = client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason="CrashLoopBackOff"))
        sim.set_state(index, waiting, last_state=terminated(code), restarts=1)

    return step


def condition(kind: str, reason: str, message: str = ""):
    def step(sim, job):
        job["status"] = {
            "conditions": [
                {
                    "type": kind,
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": rfc3339_now(),
                }
            ]
        }

    return step


def fail_node(index: int, code: int, last_words: str):
    def step(sim, job):
        sim.core.append_log(NS, sim.pods[index], last_words)
        sim.set_state(index, terminated(code))
        condition(
            "Failed", "FailedJobs", f"jobset failed due to one or more job failures (first failed job: {job_name()})"
        )(sim, job)

    return step


def job_name() -> str:
    return _plan().job.name


def _plan(**changes):
    return make_plan(training_backend="trainjob", **changes)


def _trainjob(**changes):
    plan = _plan(**changes)
    spec = build_job_spec(plan.job, plan.trainer.launch(DATA), namespace=NS)
    return build_trainjob(spec, runtime=plan.job.runtime)


def _created(sim: TrainerSim) -> list[dict]:
    return sim.custom.created(PLURAL)


def test_complete_submits_the_built_body_and_streams_node_zero(crd_dir):
    sim = TrainerSim(crd_dir)
    sim.script(
        start, log(0, "step 1 loss=2.50\n"), log(0, "eval_loss=2.05\n"), condition("Complete", "AllJobsCompleted")
    )
    job = _trainjob(training_workers=2)
    printed: list[str] = []
    result = run_trainjob(sim.cluster, job, timeout_s=5, poll_s=0.01, print_fn=printed.append)
    assert result["succeeded"] is True and result["name"] == job_name()
    assert _created(sim) == [trainjob_to_dict(job)]
    node0 = sim.pods[0]
    assert f"[{node0}] step 1 loss=2.50" in printed and f"[{node0}] eval_loss=2.05" in printed
    assert not any(sim.pods[1] in line for line in printed)  # node 1's log is not streamed
    assert printed[0].startswith(f"created TrainJob {NS}/{job_name()} (runtime torch-distributed)")


def test_failed_raises_with_the_failing_nodes_log_tail_and_a_retry_recreates_the_job(crd_dir):
    sim = TrainerSim(crd_dir)
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    sim.script(start, log(0, "step 1 loss=2.50\n"), fail_node(1, 137, "noise\n" * 60 + oom))
    with pytest.raises(TrainJobFailed) as err:
        run_trainjob(sim.cluster, _trainjob(training_workers=2), timeout_s=5, poll_s=0.01, print_fn=lambda _: None)
    message = str(err.value)
    assert "Failed (FailedJobs: jobset failed due to one or more job failures" in message
    assert "a retry of this task recreates it" in message
    assert f"last 50 log lines of pod {sim.pods[1]}" in message and oom.strip() in message
    assert message.count("noise") == 49
    assert not isinstance(err.value, JobFailedPermanently)  # 137 (OOM-killed) is retryable


def test_a_permanent_exit_ends_the_wait_suspends_the_job_and_a_retry_does_not_recreate_it(crd_dir):
    sim = TrainerSim(crd_dir)
    error = "error: /data/datasets/x/train.jsonl line 3: field messages: missing; fix the file\n"
    sim.script(start, log(0, "loading\n"), crash(0, 1, error))
    job = _trainjob()
    with pytest.raises(JobFailedPermanently) as err:
        run_trainjob(sim.cluster, job, timeout_s=5, poll_s=0.01, print_fn=lambda _: None)
    message = str(err.value)
    assert err.value.exit_code == 1
    assert f"pod {sim.pods[0]} exited 1 (bad input or config (never retried))" in message
    assert f"previous run of pod {sim.pods[0]}" in message and error.strip() in message
    stored = sim.custom.objects[(GROUP, VERSION, NS, PLURAL, job_name())]
    assert stored["spec"]["suspend"] is True  # the JobSet's pods go: no more restarts, GPUs released
    assert stored["metadata"]["annotations"][PERMANENT_EXIT_ANNOTATION] == f"pod {sim.pods[0]} exited 1"
    sim.custom.calls.clear()
    with pytest.raises(JobFailedPermanently, match="failed permanently in an earlier attempt of this task"):
        run_trainjob(sim.cluster, job, timeout_s=5, poll_s=0.01, print_fn=lambda _: None)
    assert _created(sim) == [] and not any(c[0] == "delete" for c in sim.custom.calls)


def test_a_preempted_node_restarts_in_place_and_the_wait_goes_on(crd_dir):
    sim = TrainerSim(crd_dir)
    sim.script(
        start,
        log(0, "step 100\n"),
        restart(0, 143, "SIGTERM: checkpoint-100 committed\n"),
        log(0, "resumed from checkpoint-100\n"),
        condition("Complete", "AllJobsCompleted"),
    )
    printed: list[str] = []
    result = run_trainjob(sim.cluster, _trainjob(), timeout_s=5, poll_s=0.01, print_fn=printed.append)
    assert result["succeeded"] is True
    assert any("container restarted (1 so far): previous run exited 143, preempted" in line for line in printed)
    assert f"[{sim.pods[0]}] resumed from checkpoint-100" in printed


def _existing(sim: TrainerSim, job, status: dict | None) -> None:
    body = trainjob_to_dict(job)
    sim.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    if status is not None:
        sim.custom.objects[(GROUP, VERSION, NS, PLURAL, job_name())]["status"] = status
    sim.custom.calls.clear()


def test_a_retried_task_reattaches_to_its_running_job(crd_dir):
    sim = TrainerSim(crd_dir)
    job = _trainjob()
    _existing(sim, job, None)
    sim.script(start, condition("Complete", "AllJobsCompleted"))
    printed: list[str] = []
    assert run_trainjob(sim.cluster, job, timeout_s=5, poll_s=0.01, print_fn=printed.append)["succeeded"]
    assert _created(sim) == [] and not any(c[0] == "delete" for c in sim.custom.calls)
    assert any("still running from an earlier attempt: re-attaching" in line for line in printed)


def test_a_retried_task_reuses_a_complete_job_and_recreates_a_failed_one(crd_dir):
    done = TrainerSim(crd_dir)
    job = _trainjob()
    _existing(done, job, {"conditions": [{"type": "Complete", "status": "True", "reason": "AllJobsCompleted"}]})
    assert run_trainjob(done.cluster, job, timeout_s=5, poll_s=0.01, print_fn=lambda _: None)["reused"] is True
    assert _created(done) == []

    failed = TrainerSim(crd_dir)
    _existing(failed, job, {"conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs"}]})
    failed.script(seen, start, condition("Complete", "AllJobsCompleted"))  # seen: the retry's look at the old job
    assert run_trainjob(failed.cluster, job, timeout_s=5, poll_s=0.01, print_fn=lambda _: None)["succeeded"]
    verbs = [c[0] for c in failed.custom.calls if c[0] in ("delete", "create")]
    assert verbs == ["delete", "create"]


@pytest.mark.slow
def test_timeout_names_the_job_and_shows_the_log(crd_dir):
    sim = TrainerSim(crd_dir)
    sim.script(start, log(0, "still compiling\n"))
    with pytest.raises(JobTimedOut, match="did not finish within 0s") as err:
        run_trainjob(sim.cluster, _trainjob(), timeout_s=0.05, poll_s=0.01, print_fn=lambda _: None)
    assert "still compiling" in str(err.value) and err.value.exit_code == 200
    assert (GROUP, VERSION, NS, PLURAL, job_name()) in sim.custom.objects  # left running, as documented


def test_the_deadline_is_a_timeout_not_a_training_failure(crd_dir):
    sim = TrainerSim(crd_dir)
    message = "TrainJob exceeded its activeDeadlineSeconds"
    sim.script(start, log(0, "step 9000\n"), condition("Failed", "DeadlineExceeded", message))
    with pytest.raises(JobTimedOut, match="ran into its activeDeadlineSeconds: a timeout, not a training failure"):
        run_trainjob(sim.cluster, _trainjob(), timeout_s=5, poll_s=0.01, print_fn=lambda _: None)


def test_a_missing_or_mpi_runtime_is_refused_before_submitting(crd_dir):
    missing = TrainerSim(crd_dir, runtimes=())
    with pytest.raises(ConfigError, match="training runtime ClusterTrainingRuntime/torch-distributed does not exist"):
        run_trainjob(missing.cluster, _trainjob(), timeout_s=5, poll_s=0.01)
    mpi = TrainerSim(crd_dir)
    with pytest.raises(ConfigError, match="framework deepspeed.*does not launch torchrun"):
        run_trainjob(mpi.cluster, _trainjob(training_runtime="deepspeed-distributed"), timeout_s=5, poll_s=0.01)
    assert _created(missing) == [] and _created(mpi) == []


def test_the_train_step_dispatches_backend_trainjob(crd_dir):
    sim = TrainerSim(crd_dir)
    sim.script(start, condition("Complete", "AllJobsCompleted"))
    plan = _plan()
    job = dataclasses.replace(plan.job, timeout_s=5)
    result = run_on_cluster(job, plan.trainer.launch(DATA), poll_s=0.01, cluster=sim.cluster)
    assert result["succeeded"] and [b["kind"] for b in _created(sim)] == ["TrainJob"]


def test_a_trainjob_is_owned_by_the_runs_workflow_as_a_pytorchjob_is(crd_dir):
    """Issue 34.5: the TrainJob gets the run Workflow's ownerReference (cleanup.py: the Workflow lives
    across retries and is deleted with the run, and the garbage collector then deletes the job)."""
    sim = TrainerSim(crd_dir)
    sim.script(start, condition("Complete", "AllJobsCompleted"))
    plan = _plan()
    owner = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "llm-finetune-x7k2p",
             "uid": "uid-wf", "blockOwnerDeletion": False}  # fmt: skip
    job = dataclasses.replace(plan.job, timeout_s=5)
    run_on_cluster(job, plan.trainer.launch(DATA), poll_s=0.01, cluster=sim.cluster, owner=owner)
    (created,) = _created(sim)
    assert created["metadata"]["ownerReferences"] == [owner]


def test_a_reattached_wait_ends_with_the_jobs_own_deadline():
    from llmft.components.lib.contracts.run_jobs import JOB_WAIT_GRACE_S, parse_time
    from llmft.components.lib.jobs.trainjob_launch import wait_budget

    clock = FakeClock()
    job = {"metadata": {"creationTimestamp": clock.rfc3339()}, "spec": {"activeDeadlineSeconds": 3600}}
    created = parse_time(clock.rfc3339())
    assert wait_budget(job, 7200, created + 600) == 3000 + JOB_WAIT_GRACE_S  # re-attached 10 minutes in
    assert wait_budget(job, 60, created + 600) == 60
    assert wait_budget({"metadata": {}, "spec": {}}, 60, created) == 60


def test_a_failed_trainjob_is_recreated_only_after_its_node_pods_are_gone(crd_dir):
    """Issue 29.5: the retry deletes the Failed TrainJob with foreground propagation and waits until
    its node pods (still terminating) are gone before it creates the new one under the same name
    (Kubernetes garbage collection: kubernetes.io/docs/concepts/architecture/garbage-collection)."""
    sim = TrainerSim(crd_dir)
    job = _trainjob()
    _existing(sim, job, {"conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs"}]})
    start(sim, trainjob_to_dict(job))  # the old job's node pods, terminating
    events: list[str] = []
    list_pods, create = sim.core.list_namespaced_pod, sim.custom.create_namespaced_custom_object

    def listing(namespace, label_selector=None, **kwargs):
        events.append("list")
        if events.count("list") == 3 and "gone" not in events:
            sim.core.pods[NS], sim.pods = [], []  # the kubelet confirmed their end: gone from the API
            events.append("gone")
        return list_pods(namespace, label_selector=label_selector, **kwargs)

    def creating(*args, **kwargs):
        events.append("create")
        return create(*args, **kwargs)

    sim.core.list_namespaced_pod, sim.custom.create_namespaced_custom_object = listing, creating
    sim.script(start, condition("Complete", "AllJobsCompleted"))
    assert run_trainjob(sim.cluster, job, timeout_s=5, poll_s=0.01, print_fn=lambda _: None)["succeeded"]
    assert sim.custom.propagations == ["Foreground"]
    assert events.index("gone") < events.index("create"), events


@pytest.mark.parametrize("leftover", ["deleting", "pods-only"])
def test_a_quick_retry_after_a_cancel_waits_for_the_old_node_pods(leftover, crd_dir):
    """Issue 42 (Low): a cancel's SIGTERM deleted the TrainJob (foreground: it stays, with deletionTimestamp,
    until its pods are gone), or someone deleted it in the background (its pods outlive it). A run's Retry
    seconds later must not start node pods beside the old ones still committing their checkpoint: the new
    rank 0 would meet the old run lock and exit 1, and the TrainJob would be suspended as a permanent failure.
    Before, it re-attached to the dying TrainJob, or created a new one at once."""
    sim = TrainerSim(crd_dir)
    job = _trainjob()
    start(sim, trainjob_to_dict(job))  # the cancelled attempt's node pods, still terminating
    if leftover == "deleting":
        _existing(sim, job, None)
        stored = sim.custom.objects[(GROUP, VERSION, NS, PLURAL, job_name())]
        stored["metadata"].update(deletionTimestamp=rfc3339_now(), finalizers=["foregroundDeletion"])
    events: list[str] = []
    list_pods, create = sim.core.list_namespaced_pod, sim.custom.create_namespaced_custom_object

    def listing(namespace, label_selector=None, **kwargs):
        events.append("list")
        if events.count("list") == 3 and "gone" not in events:  # the kubelet confirmed their end
            sim.core.pods[NS], sim.pods = [], []
            sim.custom.objects.pop((GROUP, VERSION, NS, PLURAL, job_name()), None)  # the GC finishes it
            events.append("gone")
        return list_pods(namespace, label_selector=label_selector, **kwargs)

    def creating(*args, **kwargs):
        events.append("create")
        sim.script(start, condition("Complete", "AllJobsCompleted"))  # the new TrainJob's controller
        return create(*args, **kwargs)

    sim.core.list_namespaced_pod, sim.custom.create_namespaced_custom_object = listing, creating
    printed: list[str] = []
    assert run_trainjob(sim.cluster, job, timeout_s=5, poll_s=0.01, print_fn=printed.append)["succeeded"]
    assert events.index("gone") < events.index("create"), events
    assert any("waiting until" in line for line in printed) and not any("re-attaching" in line for line in printed)
