"""pytorchjob_launch.run_job (submitted through the real TrainingClient) against fakes at the
kubernetes-client boundary with a scripted operator: what is submitted, how Succeeded / Failed /
timeout end, what the logs show. tests/k8s/test_job_lifecycle.py runs the same code against the
controller simulator with real trainer processes."""

from __future__ import annotations

import dataclasses

import pytest

from llmft.components.lib.plan_schema import JobTimedOut, TrainingJobFailed
from llmft.components.lib.pytorchjob import PyTorchJobSpec, build_pytorchjob, pytorchjob_to_dict
from llmft.components.lib.pytorchjob_launch import run_job

NS = "team-a"
SPEC = PyTorchJobSpec(
    name="ft-run", num_nodes=2, gpus_per_node=8, config_path="/mnt/data/c.yaml", overrides={"max_steps": 100}
)
MASTER, WORKER = "ft-run-master-0", "ft-run-worker-0"
LABELS = {"training.kubeflow.org/job-name": "ft-run"}


def _condition(kind: str, status: str = "True", reason: str = "", message: str = "") -> dict:
    return {
        "type": kind,
        "status": status,
        "reason": reason or f"PyTorchJob{kind}",
        "message": message,
        "lastTransitionTime": "2026-11-26T10:00:00Z",
        "lastUpdateTime": "2026-11-26T10:00:00Z",
    }


def _controller(core, outcome: str, *, fail_log_lines: int = 0):
    """Scripts the operator: Created, then Running with pods and a growing log, then ``outcome``."""

    def on_get(job: dict, count: int) -> None:
        status = job.setdefault("status", {"conditions": []})
        if count == 1:
            status["conditions"] = [_condition("Created")]
            core.add_pod(NS, MASTER, {**LABELS, "training.kubeflow.org/job-role": "master"}, phase="Pending")
            core.add_pod(
                NS, WORKER, {**LABELS, "training.kubeflow.org/replica-type": "worker"}, log="worker says hello\n"
            )
        elif count == 2:
            status["conditions"].append(_condition("Running"))
            status["startTime"] = "2026-11-26T10:00:05Z"
            core.set_phase(NS, MASTER, "Running")
            core.append_log(NS, MASTER, "step 1 loss=2.50\n")
        elif count == 3:
            core.append_log(NS, MASTER, "step 2 loss=2.10\neval_loss=2.05\n")
        elif count == 4 and outcome == "Succeeded":
            status["conditions"].append(_condition("Succeeded", message="PyTorchJob ft-run is successfully completed."))
            status["completionTime"] = "2026-11-26T11:00:00Z"
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
                    "Failed",
                    reason="PyTorchJobFailed",
                    message="PyTorchJob ft-run is failed because 1 Master replica(s) failed.",
                )
            )

    return on_get


def test_succeeded_job_submits_the_intended_body_and_streams_master_log(fake_cluster, fake_custom_api, fake_core_api):
    fake_custom_api.on_get = _controller(fake_core_api, "Succeeded")
    printed: list[str] = []
    result = run_job(fake_cluster, SPEC, timeout_s=5, poll_s=0.01, print_fn=printed.append, owner={})

    (submitted,) = fake_custom_api.created("pytorchjobs")
    intended = pytorchjob_to_dict(build_pytorchjob(SPEC))
    intended["metadata"]["namespace"] = NS
    assert submitted == intended
    create = next(c for c in fake_custom_api.calls if c[0] == "create")
    assert create[1:5] == ("kubeflow.org", "v1", NS, "pytorchjobs")

    assert result["succeeded"] is True and result["name"] == "ft-run" and result["namespace"] == NS
    assert [c["type"] for c in result["conditions"]] == ["Created", "Running", "Succeeded"]
    assert result["completion_time"] == "2026-11-26T11:00:00Z"
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
    fake_custom_api.on_get = _controller(fake_core_api, "Failed", fail_log_lines=80)
    with pytest.raises(TrainingJobFailed) as failure:
        run_job(fake_cluster, SPEC, timeout_s=5, poll_s=0.01, print_fn=lambda _: None, owner={})
    message = str(failure.value)
    assert isinstance(failure.value, RuntimeError)
    assert f"{NS}/ft-run Failed" in message and "1 Master replica(s) failed" in message
    assert "torch.OutOfMemoryError: CUDA out of memory" in message, "the cause must reach the error"
    assert "noise line 79" in message and "noise line 31" not in message, "only the last 50 lines"
    assert MASTER in message


def test_job_that_never_finishes_times_out_with_its_log(fake_cluster, fake_custom_api, fake_core_api):
    fake_custom_api.on_get = _controller(fake_core_api, "Running-forever")
    spec = dataclasses.replace(SPEC, active_deadline_seconds=1)  # its startTime (10:00:05 today) is long past
    with pytest.raises(JobTimedOut, match="ft-run did not finish by its deadline") as timeout:
        run_job(fake_cluster, spec, timeout_s=1, poll_s=0.01, print_fn=lambda _: None, owner={})
    assert "step 1 loss=2.50" in str(timeout.value) and timeout.value.exit_code == 200


def test_an_existing_job_of_the_same_name_is_watched_not_submitted_again(fake_cluster, fake_custom_api, fake_core_api):
    fake_custom_api.create_namespaced_custom_object(
        "kubeflow.org", "v1", NS, "pytorchjobs", pytorchjob_to_dict(build_pytorchjob(SPEC))
    )
    fake_custom_api.on_get = _controller(fake_core_api, "Succeeded")
    assert run_job(fake_cluster, SPEC, timeout_s=5, poll_s=0.01, print_fn=lambda _: None, owner={})["reattached"]
    assert len(fake_custom_api.created("pytorchjobs")) == 1


def test_poll_interval_must_fit_the_timeout(fake_cluster):
    with pytest.raises(ValueError, match="poll_s"):
        run_job(fake_cluster, SPEC, timeout_s=10, poll_s=30)
