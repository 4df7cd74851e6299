"""Pods that never start (issue 29.3): under restartPolicy ExitCode the Training Operator recreates a
pod whose container never ran (exit code 0xbeef, kubeflow/trainer v1.9.4
pkg/controller.v1/common/pod.go 339-366, retryable by pkg/util/train/train_util.go 24-26) until
activeDeadlineSeconds; the launcher stops the job after NEVER_STARTED_LIMIT such recreations
(llmft/components/lib/jobs/pod_starts.py). On the simulated cluster of cluster_sim.py; no real cluster runs here."""

from __future__ import annotations

import pytest
from kubernetes import client
from sim_plans import SIM_NAMESPACE, sim_plan

from llmft.components.lib.contracts.run_jobs import JobTimedOut
from llmft.components.lib.jobs import pod_starts
from llmft.components.lib.jobs.backends import run_on_cluster
from llmft.components.lib.jobs.pod_starts import JobNeverStarts, StartWatcher
from llmft.components.lib.jobs.pytorchjob_spec import GROUP, PLURAL, VERSION
from llmft.trainer.errors import EXIT_TRANSIENT

NOT_ADMITTED = (
    "UnexpectedAdmissionError",
    "Allocate failed due to no healthy devices present; cannot allocate unhealthy devices nvidia.com/gpu",
)


def test_a_job_whose_pods_never_start_is_stopped_with_their_reason(
    sim, fake_cluster, fake_custom_api, sim_volume, monkeypatch
):
    monkeypatch.setattr(pod_starts, "NEVER_STARTED_LIMIT", 3)
    plan = sim_plan(sim_volume, run_id="run-never-starts", training_timeout_s=30)
    sim.never_start[f"{plan.job.name}-master-0"] = NOT_ADMITTED
    with pytest.raises(JobNeverStarts) as error:
        run_on_cluster(plan.job, plan.trainer.launch(f"{sim_volume}/tokenized/demo"), cluster=fake_cluster,
                       poll_s=0.2, owner={}, print_fn=lambda _: None)  # fmt: skip
    message = str(error.value)
    assert "recreated 3 times" in message and "UnexpectedAdmissionError: Allocate failed" in message
    assert "\n" not in message and error.value.exit_code == EXIT_TRANSIENT
    assert (GROUP, VERSION, SIM_NAMESPACE, PLURAL, plan.job.name) not in fake_custom_api.objects
    assert sim.started == []


def _pod(uid: str, *, ran: bool = False, reason: str | None = None):
    state = client.V1ContainerState(running=client.V1ContainerStateRunning()) if ran else None
    statuses = [client.V1ContainerStatus(name="pytorch", image="i", image_id="", ready=ran, restart_count=0,
                                         state=state)] if ran else []  # fmt: skip
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="job-master-0", uid=uid),
        status=client.V1PodStatus(phase="Failed" if reason else "Running", reason=reason, container_statuses=statuses),
    )


def test_a_pod_that_ran_in_between_starts_the_count_again():
    watcher = StartWatcher("PyTorchJob team-a/job", "pytorch", limit=2)
    watcher([_pod("a", reason="Evicted")])
    watcher([_pod("b", reason="Evicted")])  # one recreation without a start
    watcher([_pod("c", ran=True)])  # a container ran (and may have checkpointed): the count restarts
    watcher([_pod("d", reason="Evicted")])
    watcher([_pod("e", reason="Evicted")])  # one since the start
    with pytest.raises(JobNeverStarts, match="recreated 2 times.*job-master-0: Evicted"):
        watcher([_pod("f", reason="Evicted")])


def _started_event(uid: str, container: str = "pytorch"):
    return client.CoreV1Event(
        metadata=client.V1ObjectMeta(name="job-master-0.1"),
        involved_object=client.V1ObjectReference(kind="Pod", name="job-master-0", uid=uid),
        reason="Started",
        message=f"Started container {container}",
    )


def test_a_pod_that_ran_and_crashed_between_two_polls_is_not_never_started():
    """Issue 34.5: a container OOMKilled while loading, started and gone between two polls, was seen
    only Pending. The kubelet's "Started container pytorch" event of that pod (uid) outlives it
    (kubernetes v1.30 pkg/kubelet/events/event.go StartedContainer; kuberuntime_container.go
    startContainer), so the replacement is not counted as a recreation without a start."""
    events = {"job-master-0": []}
    watcher = StartWatcher("PyTorchJob team-a/job", "pytorch", limit=2, events=events.__getitem__)
    watcher([_pod("a", reason="Pending")])
    events["job-master-0"] = [_started_event("a"), _started_event("a", "istio-proxy")]
    watcher([_pod("b", reason="Pending")])  # a ran (its event says so): not counted
    watcher([_pod("c", reason="Evicted")])  # b never started (no event of b's uid): one
    with pytest.raises(JobNeverStarts, match="recreated 2 times"):
        watcher([_pod("d", reason="Evicted")])  # c never started either: two


def test_a_container_restarted_in_place_ran_as_its_last_state_says():
    """A container that crashed and was restarted in place shows ``waiting`` now and ``terminated``
    in ``lastState``: it ran."""
    pod = _pod("a", reason="Pending")
    pod.status.container_statuses = [client.V1ContainerStatus(
        name="pytorch", image="i", image_id="", ready=False, restart_count=1,
        state=client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason="CrashLoopBackOff")),
        last_state=client.V1ContainerState(terminated=client.V1ContainerStateTerminated(exit_code=137,
                                                                                        reason="OOMKilled")),
    )]  # fmt: skip
    assert pod_starts.container_ran(pod, "pytorch")
    assert not pod_starts.container_ran(_pod("b", reason="Pending"), "pytorch")


@pytest.mark.parametrize(
    "error",
    [JobNeverStarts("PyTorchJob team-a/job: its pods were recreated 5 times"), JobTimedOut("did not finish")],
    ids=["never-starts", "timed-out"],
)
def test_the_train_step_exits_with_the_retryable_code_not_1(error, tmp_path, monkeypatch, capsys, sim_volume):
    """Issue 34.5: the train component maps the launcher's errors to the exit-code contract
    (llmft/trainer/errors.py: 200 transient) instead of the traceback and exit 1 of an uncaught exception."""
    from kfp import dsl

    from llmft.components.lib.contracts.schema import write_plan
    from llmft.components.lib.jobs import backends
    from llmft.components.train import train_model

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(backends, "run_on_cluster", fail)
    plan = sim_plan(sim_volume, run_id="run-exit-code")
    plan_artifact = dsl.Artifact(uri=str(tmp_path / "plan"))
    write_plan(plan, plan_artifact.path)
    tokenized = dsl.Dataset(uri=str(tmp_path / "tokenized"), metadata={"path": f"{sim_volume}/tokenized/demo"})
    kinds = (("run", dsl.Model), ("metrics", dsl.Metrics), ("loss_curve", dsl.HTML))
    outputs = {name: cls(uri=str(tmp_path / name)) for name, cls in kinds}
    with pytest.raises(SystemExit) as stopped:
        train_model.python_func(plan=plan_artifact, tokenized=tokenized, **outputs)
    assert stopped.value.code == EXIT_TRANSIENT
    assert f"error (exit {EXIT_TRANSIENT}): {error}" in capsys.readouterr().err
