"""Issue 34.1: an evicted launcher never costs the job. When a node drains, Argo may lose the launcher pod
before it records the pod's phase: the node becomes Error "pod deleted" (argo-workflows
workflow/controller/operator.go 1175 at v3.4.17, 1289 at v4.0.5), which KFP's retryStrategy (no
retryPolicy: OnFailure, operator.go 1035-1042; kubeflow/pipelines backend/src/v2/compiler/argocompiler/
container.go 473-504 at 2.4.1) does not retry. The run fails and its exit handler runs: it keeps the job
(the evicted launcher marked it; or the Workflow shows the lost pod), and KFP's retry of the run (same
Workflow and run id: kubeflow/pipelines 2.4.1 backend/src/common/util/workflow.go 195-250) re-attaches to
it. On the simulated cluster of cluster_sim.py; no real cluster runs here."""

from __future__ import annotations

import signal
import threading

import pytest
from cluster_sim import ClusterSim
from kubernetes import client
from sim_plans import SIM_NAMESPACE, sim_plan

from llmft.components.lib.contracts.run_jobs import run_label
from llmft.components.lib.jobs.backends import run_on_cluster
from llmft.components.lib.jobs.cleanup import cleanup_after_run
from llmft.components.lib.jobs.launcher_pod import KEEP_ANNOTATION, delete_on_sigterm
from llmft.components.lib.jobs.pytorchjob_spec import GROUP, PLURAL, VERSION

WORKFLOW = "llm-finetune-q4m8z"
LAUNCHER = f"{WORKFLOW}-system-container-impl-1"
EXIT_HANDLER = f"{WORKFLOW}-system-container-impl-9"
RETRY = f"{WORKFLOW}-system-container-impl-2"
RUN_ID = "7c1e2f3a-0b4d-4e5f-8a9b-0c1d2e3f4a5b"
ON_KFP = {"KFP_POD_NAME": EXIT_HANDLER, "KFP_POD_UID": "uid-exit"}  # the exit handler's pod (plan_schema KFP_POD_ENV)


@pytest.fixture
def launcher_sim(tmp_path, fake_custom_api, fake_core_api):
    """A simulator with no volume (nothing runs), for the decisions alone."""
    return ClusterSim(fake_custom_api, fake_core_api, SIM_NAMESPACE, tmp_path / "pods")


def _unfinished_job(fake_custom_api, name: str, annotations: dict | None = None) -> tuple:
    key = ("trainer.kubeflow.org", "v1alpha1", SIM_NAMESPACE, "trainjobs", name)  # no simulated controller
    metadata = {
        "name": name,
        "namespace": SIM_NAMESPACE,
        "labels": {"pipelines.kubeflow.org/run-id": run_label(RUN_ID)},
    }
    fake_custom_api.objects[key] = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                                    "metadata": {**metadata, "annotations": annotations or {}}}  # fmt: skip
    return key


def test_an_evicted_launcher_marks_its_job_and_the_exit_handler_keeps_it(
    launcher_sim, fake_cluster, fake_custom_api, monkeypatch
):
    monkeypatch.setenv("KFP_POD_NAME", LAUNCHER)
    launcher_sim.kfp_launcher(LAUNCHER, WORKFLOW, deadline_s=3600)
    job = _unfinished_job(fake_custom_api, "ft-drained")
    printed: list[str] = []
    drained = client.V1PodCondition(type="DisruptionTarget", status="True", reason="EvictionByEvictionAPI")
    with delete_on_sigterm(fake_cluster, job[0], job[1], job[3], job[4], print_fn=printed.append):
        launcher_sim._pod(LAUNCHER).status.conditions = [drained]  # what sim.evict sets, without the signal
        with pytest.raises(SystemExit) as stopped:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert stopped.value.code == 143
    assert "EvictionByEvictionAPI" in fake_custom_api.objects[job]["metadata"]["annotations"][KEEP_ANNOTATION]
    launcher_sim.lose_pod(WORKFLOW, LAUNCHER)
    launcher_sim.task_pod(EXIT_HANDLER, WORKFLOW)
    report = cleanup_after_run(RUN_ID, environ=ON_KFP, cluster=fake_cluster)
    assert report["kept_for_retry"] == ["TrainJob/ft-drained"] and report["deleted"] == []
    assert job in fake_custom_api.objects


def test_a_lost_launcher_without_a_mark_keeps_the_runs_jobs_too(launcher_sim, fake_cluster, fake_custom_api):
    """A node that went away sends no SIGTERM: nothing marked the job, but the Workflow shows the lost pod."""
    launcher_sim.kfp_launcher(LAUNCHER, WORKFLOW)
    job = _unfinished_job(fake_custom_api, "ft-node-lost")
    launcher_sim.lose_pod(WORKFLOW, LAUNCHER)
    launcher_sim.task_pod(EXIT_HANDLER, WORKFLOW)
    report = cleanup_after_run(RUN_ID, environ=ON_KFP, cluster=fake_cluster)
    assert report["kept_for_retry"] == ["TrainJob/ft-node-lost"] and job in fake_custom_api.objects


def test_a_run_that_failed_otherwise_still_frees_the_gpus(launcher_sim, fake_cluster, fake_custom_api):
    launcher_sim.kfp_launcher(LAUNCHER, WORKFLOW)
    job = _unfinished_job(fake_custom_api, "ft-failed")
    launcher_sim.task_pod(EXIT_HANDLER, WORKFLOW)
    report = cleanup_after_run(RUN_ID, environ=ON_KFP, cluster=fake_cluster)
    assert report["deleted"] == ["TrainJob/ft-failed"] and job not in fake_custom_api.objects


def _job_key(plan) -> tuple:
    return (GROUP, VERSION, SIM_NAMESPACE, PLURAL, plan.job.name)


@pytest.mark.slow
def test_a_drain_during_training_errors_the_node_and_the_runs_retry_resumes_the_same_job(
    sim, fake_cluster, fake_custom_api, sim_volume, monkeypatch
):
    """The whole path: the drain SIGTERMs the launcher (evicted: it keeps and marks the job) and the
    master (the trainer commits a checkpoint and exits 143, recreated by the operator); Argo loses the
    launcher pod (Error "pod deleted"); the exit handler keeps the job; the run's retry re-attaches to
    the same job, whose trainer resumes from its checkpoint and finishes."""
    monkeypatch.setenv("KFP_POD_NAME", LAUNCHER)
    sim.kfp_launcher(LAUNCHER, WORKFLOW)
    plan = sim_plan(sim_volume, run_id=RUN_ID, finetune_max_steps=6)
    master, printed = f"{plan.job.name}-master-0", []

    def drain() -> None:
        sim.wait_for_log(master, "step=2 ")
        sim.containers[master].signal(signal.SIGTERM)  # the kubelet stops the drained node's pods
        sim.evict(LAUNCHER)

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the test: the launcher did not handle it")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        threading.Thread(target=drain, daemon=True).start()
        with pytest.raises(SystemExit) as stopped:
            run_on_cluster(plan.job, plan.trainer.launch(f"{sim_volume}/tokenized/demo"), cluster=fake_cluster,
                           poll_s=0.2, print_fn=printed.append)  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143 and any("keeping pytorchjobs" in line for line in printed), printed[-5:]
    sim.lose_pod(WORKFLOW, LAUNCHER)
    sim.task_pod(EXIT_HANDLER, WORKFLOW)
    report = cleanup_after_run(RUN_ID, environ=ON_KFP, cluster=fake_cluster)
    assert report["kept_for_retry"] == [f"PyTorchJob/{plan.job.name}"] and report["deleted"] == []
    uid = fake_custom_api.objects[_job_key(plan)]["metadata"]["uid"]

    sim.retry_run(WORKFLOW, RETRY)
    monkeypatch.setenv("KFP_POD_NAME", RETRY)
    result = run_on_cluster(plan.job, plan.trainer.launch(f"{sim_volume}/tokenized/demo"), cluster=fake_cluster,
                            poll_s=0.2, print_fn=printed.append)  # fmt: skip
    assert result["succeeded"] and result["reattached"]
    job = fake_custom_api.objects[_job_key(plan)]
    assert job["metadata"]["uid"] == uid and KEEP_ANNOTATION not in (job["metadata"].get("annotations") or {})
    assert [c[0] for c in fake_custom_api.calls if c[0] in ("create", "delete") and c[4] == PLURAL] == ["create"]
    assert [code for pod, code in sim.history if pod == master] == [143, 0], sim.history
    assert "resuming from" in sim.containers[master].text()
