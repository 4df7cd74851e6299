"""The train step's job on a simulated cluster (cluster_sim.py): the real launcher
(llmft/components/lib/jobs/pytorchjob_launch.py) against the Training Operator's documented semantics, with real
`llmft train` processes on the tiny model as the pods. No real cluster runs here.

Each test names the issue-15 item it covers."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from cluster_sim import Chaos
from sim_plans import SIM_NAMESPACE, TINY_TRAIN, sim_plan

from llmft.components.lib.cluster import ClusterError
from llmft.components.lib.contracts.run_jobs import JobFailedPermanently, JobTimedOut
from llmft.components.lib.jobs.backends import run_on_cluster
from llmft.components.lib.jobs.pytorchjob_spec import (
    GROUP,
    PLURAL,
    VERSION,
    build_job_spec,
    build_pytorchjob,
    pytorchjob_to_dict,
)
from llmft.trainer.errors import EXIT_TRANSIENT, EXIT_USER_ERROR
from llmft.trainer.io import is_complete

pytestmark = pytest.mark.slow
DATA = "tokenized/demo"


def _overrides(plan, data: str | None = None) -> list[str]:
    return plan.trainer.launch(data or f"{plan.layout.root}/{DATA}")


def _run(plan, cluster, *, data: str | None = None, **kwargs):
    kwargs.setdefault("poll_s", 0.2)
    kwargs.setdefault("owner", {})
    return run_on_cluster(plan.job, _overrides(plan, data), cluster=cluster, **kwargs)


def _job(custom, name: str) -> dict:
    return custom.objects[(GROUP, VERSION, SIM_NAMESPACE, PLURAL, name)]


def _calls(custom, verb: str) -> list:
    return [c for c in custom.calls if c[0] == verb and c[4] == PLURAL]


def _wait_until(predicate, timeout_s: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_job_succeeds_through_api_errors_with_its_log_streamed(sim, fake_cluster, fake_custom_api, sim_volume):
    """Item 7: transient API errors inside the wait loop are retried (with a bound)."""
    plan = sim_plan(sim_volume, run_id="run-success")
    printed = []

    def print_fn(line: str) -> None:
        printed.append(line)
        if line.startswith("created PyTorchJob"):
            fake_custom_api.fail_next(3, 503)  # the API server blinks right after the submit

    result = _run(plan, fake_cluster, print_fn=print_fn)
    assert result["succeeded"] and not result["reattached"]
    assert (sim_volume / "runs" / "run-success" / "final" / "training_manifest.json").is_file()
    assert any("step=3 " in line and line.startswith(f"[{plan.job.name}-master-0]") for line in printed)
    assert sum("HTTP 503" in line for line in printed) == 3
    job = _job(fake_custom_api, plan.job.name)
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == plan.job.timeout_s  # item 6
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"  # item 12
    assert job["metadata"]["labels"]["pipelines.kubeflow.org/run-id"] == "run-success"


def test_more_api_errors_in_a_row_than_the_bound_fail_the_wait(sim, fake_cluster, fake_custom_api, sim_volume):
    plan = sim_plan(sim_volume, run_id="run-api-down", finetune_max_steps=200)

    def print_fn(line: str) -> None:
        if line.startswith("created PyTorchJob"):
            fake_custom_api.fail_next(50, 503)

    with pytest.raises(ClusterError, match="HTTP 503") as error:
        _run(plan, fake_cluster, print_fn=print_fn, api_retries=2)
    assert error.value.transient


def test_pods_killed_137_again_and_again_end_in_failed_not_48_hours_of_restarts(
    sim, fake_cluster, fake_custom_api, sim_volume
):
    """Item 6: under restartPolicy ExitCode the operator recreates a pod that died with 137 forever
    (its backoffLimit never trips); the trainer's restart budget ends the loop with exit 1, which the
    launcher reports as a permanent failure with the pod's log; activeDeadlineSeconds is the plan's."""
    plan = sim_plan(
        sim_volume,
        run_id="run-oom-loop",
        finetune_max_steps=500,
        training_timeout_s=3600,
        finetune_overrides=f"max_restarts_without_progress=1 save_every=0 {TINY_TRAIN}",
    )
    master = f"{plan.job.name}-master-0"
    sim.chaos.append(Chaos(master, "step=1 ", signal.SIGKILL))  # an OOM kill each time it trains
    with pytest.raises(JobFailedPermanently) as error:
        _run(plan, fake_cluster, print_fn=lambda _: None)
    assert error.value.exit_code == EXIT_USER_ERROR
    message = str(error.value)
    assert f"pod {master} exited 1" in message and "max_restarts_without_progress=1" in message
    assert [code for pod, code in sim.history if pod == master] == [137, 137, 1]
    job = _job(fake_custom_api, plan.job.name)
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == 3600
    assert [c["type"] for c in job["status"]["conditions"] if c["status"] == "True"][-1] == "Failed"


def test_a_job_past_its_deadline_is_a_timeout_and_frees_its_pods(sim, fake_cluster, fake_custom_api, sim_volume):
    """Items 6 and 7: activeDeadlineSeconds follows job_timeout_s; the operator fails the job at the
    deadline, cleanPodPolicy Running stops its pods, and the step reports a timeout (exit 200)."""
    plan = sim_plan(sim_volume, run_id="run-deadline", finetune_max_steps=5000, training_timeout_s=10)
    with pytest.raises(JobTimedOut, match="activeDeadlineSeconds") as error:
        _run(plan, fake_cluster, print_fn=lambda _: None)
    assert error.value.exit_code == EXIT_TRANSIENT
    assert "timeout, not a training failure" in str(error.value)
    _wait_until(lambda: not sim.running(), 60, "the pods to stop")
    with pytest.raises(JobTimedOut, match="earlier attempt"):  # a retry does not start the budget again
        _run(plan, fake_cluster, print_fn=lambda _: None)
    assert len(_calls(fake_custom_api, "create")) == 1


def test_a_retry_reattaches_to_the_running_job_and_never_deletes_it(sim, fake_cluster, fake_custom_api, sim_volume):
    """Item 7: the first attempt's launcher pod died; its job runs on; the retry waits for it."""
    plan = sim_plan(sim_volume, run_id="run-reattach", finetune_max_steps=6)
    first = pytorchjob_to_dict(build_pytorchjob(build_job_spec(plan.job, _overrides(plan))))
    fake_cluster.create_custom_object(GROUP, VERSION, PLURAL, first)
    master = f"{plan.job.name}-master-0"
    sim.wait_for_log(master, "step=1 ")  # the first attempt's job trains
    printed = []
    result = _run(plan, fake_cluster, print_fn=printed.append)
    assert result["succeeded"] and result["reattached"]
    assert any("re-attaching" in line for line in printed)
    assert len(_calls(fake_custom_api, "create")) == 1 and not _calls(fake_custom_api, "delete")
    assert [pod for pod, _ in sim.history] == [master], "one container ran the whole job: nothing was restarted"


def test_a_permanently_failed_job_is_never_recreated(sim, fake_cluster, fake_custom_api, sim_volume):
    """Item 7: exit 1 (bad input) fails the step with the pod's log; a retry fails the same way at
    once instead of deleting and recreating the job."""
    plan = sim_plan(sim_volume, run_id="run-bad-data")
    with pytest.raises(JobFailedPermanently) as error:
        _run(plan, fake_cluster, data=f"{sim_volume}/tokenized/missing", print_fn=lambda _: None)
    message = str(error.value)
    assert "exited 1 (bad input or configuration" in message and "tokenized/missing" in message
    with pytest.raises(JobFailedPermanently, match="in an earlier attempt of this task"):
        _run(plan, fake_cluster, data=f"{sim_volume}/tokenized/missing", print_fn=lambda _: None)
    assert len(_calls(fake_custom_api, "create")) == 1 and not _calls(fake_custom_api, "delete")


@pytest.mark.parametrize(
    ("cause", "expected", "hint"),
    [
        ("no-gpu", "Insufficient nvidia.com/gpu", "no node has enough free GPUs"),
        ("no-secret", 'CreateContainerConfigError: secret "llmft-hf-token" not found', "a Secret or key"),
        ("no-image", "ImagePullBackOff", "check trainer_image"),
        ("no-pvc", 'persistentvolumeclaim "llmft-data" not found', "check pvc_name"),
    ],
)
def test_pending_pods_are_explained_at_most_once_per_n_polls(
    cause, expected, hint, sim, fake_cluster, sim_volume, tmp_path
):
    """Item 10: why the job stays Pending reaches the step's log, every ``pending_every`` polls."""
    plan = sim_plan(sim_volume, run_id=f"run-{cause}", training_timeout_s=4, hf_token_secret="llmft-hf-token")
    sim.secrets = {} if cause == "no-secret" else {"llmft-hf-token": {"HF_TOKEN": "not-a-real-token"}}
    sim.gpus = 0 if cause == "no-gpu" else None
    if cause == "no-image":
        sim.unpullable = {plan.job.image}
    if cause == "no-pvc":
        sim.volumes = {}
    printed = []
    with pytest.raises(JobTimedOut):
        _run(plan, fake_cluster, print_fn=printed.append, pending_every=5)
    reports = [line for line in printed if "Pending:" in line]
    polls = sum(1 for c in fake_cluster.custom_api.calls if c[0] == "get")
    assert reports and all(expected in line and hint in line for line in reports), printed[-5:]
    assert len(reports) <= polls // 5
    assert not sim.containers, "nothing ran"


def test_sigterm_to_the_launcher_deletes_its_job_and_the_trainer_commits(
    sim, fake_cluster, fake_custom_api, sim_volume, monkeypatch
):
    """Item 2: a cancelled run's launcher gets SIGTERM (Argo, exec_control.go 56-64); it deletes the
    PyTorchJob (foreground), whose pods get SIGTERM in turn and commit a checkpoint before they stop."""
    plan = sim_plan(sim_volume, run_id="run-cancel", finetune_max_steps=5000)
    master = f"{plan.job.name}-master-0"
    launcher, workflow = "llm-finetune-x7k2p-system-container-impl-1", "llm-finetune-x7k2p"
    monkeypatch.setenv("KFP_POD_NAME", launcher)
    sim.kfp_launcher(launcher, workflow, deadline_s=3600)

    class Cancelled(Exception):
        pass

    def cancel_when_training() -> None:
        sim.wait_for_log(master, "step=2 ")
        sim.cancel_run(workflow)  # KFP's cancel: activeDeadlineSeconds 0, then Argo's SIGTERM

    def unhandled(signum, frame):  # what would kill this test process without the launcher's handler
        raise Cancelled("SIGTERM reached the test: the launcher did not handle it")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        threading.Thread(target=cancel_when_training, daemon=True).start()
        with pytest.raises(SystemExit) as stopped:
            _run(plan, fake_cluster, print_fn=lambda _: None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143 and fake_custom_api.propagations == ["Foreground"]
    _wait_until(lambda: not sim.running(), 120, "the job's pods to stop")
    sim.reconcile()
    assert (GROUP, VERSION, SIM_NAMESPACE, PLURAL, plan.job.name) not in fake_custom_api.objects
    checkpoints = sim_volume / "runs" / "run-cancel" / "checkpoints"
    assert [p for p in checkpoints.iterdir() if is_complete(p)], "the trainer committed a checkpoint on the way out"


def test_a_worker_killed_without_sigterm_restarts_the_whole_job_from_its_checkpoint(
    sim, fake_cluster, fake_custom_api, sim_volume
):
    """Item 12: two nodes; the Worker's container is SIGKILLed (a lost node, an OOM kill: no SIGTERM,
    so no stop flag is all-reduced). The Master's rank loses its peer; it must exit retryably so the
    operator restarts it as well, and both rejoin a fresh rendezvous and resume from the newest
    complete checkpoint, instead of failing the job for good."""
    plan = sim_plan(
        sim_volume, run_id="run-lost-worker", training_workers=2, finetune_max_steps=6,
        finetune_overrides=f"save_every=2 {TINY_TRAIN}",
    )  # fmt: skip
    worker = f"{plan.job.name}-worker-0"
    sim.chaos.append(Chaos(worker, "step=3 ", signal.SIGKILL, times=1, watch=f"{plan.job.name}-master-0"))
    printed = []
    result = _run(plan, fake_cluster, print_fn=printed.append)
    assert result["succeeded"]
    master = f"{plan.job.name}-master-0"
    assert sim.history[:2] == [(worker, 137), (master, 200)], sim.history  # the lost peer: retryable, not 1 or 3
    assert sim.started.count(master) == sim.started.count(worker) == 2, sim.started  # both pods restarted
    assert (master, 0) in sim.history[2:], sim.history
    # The job succeeds when its Master does; a Worker still ending then is deleted by cleanPodPolicy
    # Running (what the operator does), so its second exit is recorded only when it came first.
    assert set(sim.history[2:]) <= {(master, 0), (worker, 0)}, sim.history
    assert any("resuming from" in line for line in printed), printed[-30:]
    # A Worker still running when the job succeeded gets SIGTERM from cleanPodPolicy and its grace
    # period (pod termination is asynchronous): it must be gone within that grace.
    _wait_until(lambda: not sim.running(), 60, "the Worker deleted by cleanPodPolicy to stop")
