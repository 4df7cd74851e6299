"""pytorchjob_launch.run_job (submitted through the real TrainingClient) against fakes at the
kubernetes-client boundary with a scripted operator: what is submitted, how Succeeded / Failed /
timeout end, what the logs show. tests/k8s/test_job_lifecycle.py runs the same code against the
controller simulator with real trainer processes."""

from __future__ import annotations

import dataclasses

import pytest
from fake_clock import FakeClock

from llmft.components.lib.contracts.run_jobs import JobTimedOut, TrainingJobFailed
from llmft.components.lib.jobs.pytorchjob_launch import run_job
from llmft.components.lib.jobs.pytorchjob_spec import JobSpec, build_pytorchjob, pytorchjob_to_dict

NS = "team-a"
SPEC = JobSpec(
    name="ft-run", num_nodes=2, gpus_per_node=8, config_path="/mnt/data/c.yaml", overrides={"max_steps": 100}
)
MASTER, WORKER = "ft-run-master-0", "ft-run-worker-0"
LABELS = {"training.kubeflow.org/job-name": "ft-run"}


def _condition(clock: FakeClock, kind: str, status: str = "True", reason: str = "", message: str = "") -> dict:
    return {
        "type": kind,
        "status": status,
        "reason": reason or f"PyTorchJob{kind}",
        "message": message,
        "lastTransitionTime": clock.rfc3339(),
        "lastUpdateTime": clock.rfc3339(),
    }


def _controller(core, outcome: str, clock: FakeClock, *, fail_log_lines: int = 0, started_ago_s: float = 0.0):
    """Scripts the operator on ``clock``: Created, then Running (``startTime`` ``started_ago_s`` before the
    clock's time then) with pods and a growing log, then ``outcome``."""

    def on_get(job: dict, count: int) -> None:
        status = job.setdefault("status", {"conditions": []})
        if count == 1:
            status["conditions"] = [_condition(clock, "Created")]
            core.add_pod(NS, MASTER, {**LABELS, "training.kubeflow.org/job-role": "master"}, phase="Pending")
            core.add_pod(
                NS, WORKER, {**LABELS, "training.kubeflow.org/replica-type": "worker"}, log="worker says hello\n"
            )
        elif count == 2:
            status["conditions"].append(_condition(clock, "Running"))
            status["startTime"] = clock.rfc3339(-started_ago_s)
            core.set_phase(NS, MASTER, "Running")
            core.append_log(NS, MASTER, "step 1 loss=2.50\n")
        elif count == 3:
            core.append_log(NS, MASTER, "step 2 loss=2.10\neval_loss=2.05\n")
        elif count == 4 and outcome == "Succeeded":
            status["conditions"].append(
                _condition(clock, "Succeeded", message="PyTorchJob ft-run is successfully completed.")
            )
            status["completionTime"] = clock.rfc3339()
            core.append_log(NS, MASTER, "saved final adapter\n")
        elif count == 4 and outcome == "Failed":
            lines = "".join(f"noise line {i}\n" for i in range(fail_log_lines))
            core.append_log(
                NS,
                MASTER,
                lines + "Traceback (most recent call last):\n"
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n",
            )
            core.set_phase(NS, MASTER, "Failed")
            status["conditions"].append(
                _condition(
                    clock,
                    "Failed",
                    reason="PyTorchJobFailed",
                    message="PyTorchJob ft-run is failed because 1 Master replica(s) failed.",
                )
            )

    return on_get


def test_succeeded_job_submits_the_intended_body_and_streams_master_log(fake_cluster, fake_custom_api, fake_core_api):
    clock = FakeClock()
    fake_custom_api.on_get = _controller(fake_core_api, "Succeeded", clock)
    printed: list[str] = []
    result = run_job(
        fake_cluster, SPEC, timeout_s=5, poll_s=0.01, print_fn=printed.append, owner={}, clock=clock, sleep=clock.sleep
    )

    (submitted,) = fake_custom_api.created("pytorchjobs")
    intended = pytorchjob_to_dict(build_pytorchjob(SPEC))
    intended["metadata"]["namespace"] = NS
    assert submitted == intended
    create = next(c for c in fake_custom_api.calls if c[0] == "create")
    assert create[1:5] == ("kubeflow.org", "v1", NS, "pytorchjobs")

    assert result["succeeded"] is True and result["name"] == "ft-run" and result["namespace"] == NS
    assert [c["type"] for c in result["conditions"]] == ["Created", "Running", "Succeeded"]
    assert result["completion_time"] == clock.rfc3339() and result["start_time"] <= result["completion_time"]
    log_lines = [p for p in printed if p.startswith(f"[{MASTER}]")]
    assert log_lines == [
        f"[{MASTER}] step 1 loss=2.50",
        f"[{MASTER}] step 2 loss=2.10",
        f"[{MASTER}] eval_loss=2.05",
        f"[{MASTER}] saved final adapter",
    ], "each line once, in order"
    assert not any("worker says hello" in p for p in printed), "only the master's log is streamed"
    assert {r["container"] for r in fake_core_api.log_reads} == {"pytorch"}


def test_failed_job_raises_with_reason_and_last_log_lines(fake_cluster, fake_custom_api, fake_core_api):
    clock = FakeClock()
    fake_custom_api.on_get = _controller(fake_core_api, "Failed", clock, fail_log_lines=80)
    with pytest.raises(TrainingJobFailed) as failure:
        run_job(
            fake_cluster,
            SPEC,
            timeout_s=5,
            poll_s=0.01,
            print_fn=lambda _: None,
            owner={},
            clock=clock,
            sleep=clock.sleep,
        )
    message = str(failure.value)
    assert isinstance(failure.value, RuntimeError)
    assert f"{NS}/ft-run Failed" in message and "1 Master replica(s) failed" in message
    assert "torch.OutOfMemoryError: CUDA out of memory" in message, "the cause must reach the error"
    assert "noise line 79" in message and "noise line 31" not in message, "only the last 50 lines"
    assert MASTER in message


def test_job_that_never_finishes_times_out_with_its_log(fake_cluster, fake_custom_api, fake_core_api):
    clock = FakeClock()
    fake_custom_api.on_get = _controller(fake_core_api, "Running-forever", clock, started_ago_s=3600)
    spec = dataclasses.replace(SPEC, active_deadline_seconds=1)  # it started an hour before the clock's time
    with pytest.raises(JobTimedOut, match="ft-run did not finish by its deadline") as timeout:
        run_job(
            fake_cluster,
            spec,
            timeout_s=1,
            poll_s=0.01,
            print_fn=lambda _: None,
            owner={},
            clock=clock,
            sleep=clock.sleep,
        )
    assert "step 1 loss=2.50" in str(timeout.value) and timeout.value.exit_code == 200


def test_an_existing_job_of_the_same_name_is_watched_not_submitted_again(fake_cluster, fake_custom_api, fake_core_api):
    fake_custom_api.create_namespaced_custom_object(
        "kubeflow.org", "v1", NS, "pytorchjobs", pytorchjob_to_dict(build_pytorchjob(SPEC))
    )
    clock = FakeClock()
    fake_custom_api.on_get = _controller(fake_core_api, "Succeeded", clock)
    assert run_job(
        fake_cluster, SPEC, timeout_s=5, poll_s=0.01, print_fn=lambda _: None, owner={}, clock=clock, sleep=clock.sleep
    )["reattached"]
    assert len(fake_custom_api.created("pytorchjobs")) == 1


def test_poll_interval_must_fit_the_timeout(fake_cluster):
    with pytest.raises(ValueError, match="poll_s"):
        run_job(fake_cluster, SPEC, timeout_s=10, poll_s=30)


@pytest.mark.parametrize("days_ahead", [0, 365, 3650])
@pytest.mark.parametrize("outcome", ["Succeeded", "Running-forever"])
def test_the_deadline_counts_from_the_jobs_own_start_on_any_day(
    fake_cluster, fake_custom_api, fake_core_api, days_ahead, outcome
):
    """Issue 33.1: the wait's deadline is the job's startTime + activeDeadlineSeconds (+ grace) read on the
    launcher's clock, whatever the date: a job that started just now finishes, one that started a day
    before its 1-hour deadline times out, on today's clock as on one 1 or 10 years ahead."""
    clock = FakeClock(FakeClock().now + days_ahead * 86400)
    late = outcome == "Running-forever"
    fake_custom_api.on_get = _controller(fake_core_api, outcome, clock, started_ago_s=86400 if late else 0)
    spec = dataclasses.replace(SPEC, active_deadline_seconds=3600)
    wait = dict(timeout_s=5, poll_s=0.01, print_fn=lambda _: None, owner={}, clock=clock, sleep=clock.sleep)
    if late:
        with pytest.raises(JobTimedOut):
            run_job(fake_cluster, spec, **wait)
    else:
        assert run_job(fake_cluster, spec, **wait)["succeeded"]
