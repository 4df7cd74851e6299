"""A failed or cancelled run frees its GPUs (llmft/components/lib/jobs/cleanup.py), on the
simulated cluster of cluster_sim.py (pods are real local processes; no real cluster runs here)."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from k8s_fakes import api_error
from kubernetes import client
from sim_plans import SIM_NAMESPACE, sim_plan

from llmft.components.lib.cluster import ClusterError
from llmft.components.lib.contracts.run_jobs import RUN_ID_LABEL, JobFailedPermanently, run_label
from llmft.components.lib.jobs.backends import run_on_cluster
from llmft.components.lib.jobs.cleanup import cleanup_after_run, cleanup_run

RUN = "7e1f0c2a-55aa-4c1b-9d3e-31f2a8b6c0de"
OTHER = "0b9d7c6e-1111-4a2b-8c3d-4e5f60718293"
WORKFLOW = client.V1OwnerReference(
    api_version="argoproj.io/v1alpha1", kind="Workflow", name="llm-finetune-x7k2p", uid="wf-uid-1", controller=True
)


def _sleeping_job(name: str, run_id: str, status: dict | None = None) -> dict:
    """A PyTorchJob of ``run_id`` whose pod just sleeps (the cleanup does not care what it runs)."""
    container = {"name": "pytorch", "image": "busybox", "command": ["sleep", "300"]}
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": {RUN_ID_LABEL: run_label(run_id)}},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": 1,
                    "restartPolicy": "ExitCode",
                    "template": {"spec": {"containers": [container]}},
                }
            },
            "runPolicy": {"cleanPodPolicy": "None"},
        },
    }
    return {**job, "status": status} if status else job


def _experiment(name: str, run_id: str) -> dict:
    return {
        "apiVersion": "kubeflow.org/v1beta1",
        "kind": "Experiment",
        "metadata": {"name": name, "labels": {RUN_ID_LABEL: run_label(run_id)}},
        "spec": {},
    }


@pytest.mark.slow
def test_the_exit_handler_deletes_only_the_runs_unfinished_jobs(sim, fake_cluster, fake_custom_api):
    succeeded = {"conditions": [{"type": "Succeeded", "status": "True", "reason": "x", "message": "done"}]}
    for body, plural, version in (
        (_sleeping_job("run-train", RUN), "pytorchjobs", "v1"),
        (_sleeping_job("run-old-trial", RUN, succeeded), "pytorchjobs", "v1"),
        (_sleeping_job("other-train", OTHER), "pytorchjobs", "v1"),
        (_experiment("run-sweep", RUN), "experiments", "v1beta1"),
    ):
        fake_cluster.create_custom_object("kubeflow.org", version, plural, body)
    fake_custom_api.unserved = {"trainjobs"}  # no Kubeflow Trainer v2 on this cluster: skipped
    sim.reconcile()
    assert sorted(sim.running()) == ["other-train-master-0", "run-train-master-0"]

    report = cleanup_run(fake_cluster, RUN, print_fn=lambda _: None)
    assert sorted(report["deleted"]) == ["Experiment/run-sweep", "PyTorchJob/run-train"]
    assert report["kept"] == ["PyTorchJob/run-old-trial"]
    assert set(fake_custom_api.propagations) == {"Foreground"}  # the job stays until its pods are gone
    # The deleted job's pod gets SIGTERM and its grace period (pod termination is asynchronous): it
    # must be gone within that grace, while the other run's job keeps running.
    deadline = time.monotonic() + 60
    while "run-train-master-0" in sim.running() and time.monotonic() < deadline:
        sim.reconcile()
        time.sleep(0.2)
    assert sim.running() in ([], ["other-train-master-0"]) and "run-train-master-0" not in sim.running()
    sim.reconcile()
    left = {key[-1] for key in fake_custom_api.objects}
    assert left == {"run-old-trial", "other-train"}


@pytest.mark.slow
def test_what_cannot_be_deleted_is_named_with_the_command_to_do_it(sim, fake_cluster, fake_custom_api, monkeypatch):
    fake_cluster.create_custom_object("kubeflow.org", "v1", "pytorchjobs", _sleeping_job("run-train", RUN))

    def forbidden(*_args, **_kwargs):
        raise api_error(403, 'pytorchjobs.kubeflow.org "run-train" is forbidden')

    monkeypatch.setattr(fake_custom_api, "delete_namespaced_custom_object", forbidden)
    with pytest.raises(ClusterError) as error:
        cleanup_run(fake_cluster, RUN, print_fn=lambda _: None)
    message = str(error.value)
    assert "PyTorchJob/run-train" in message and "HTTP 403" in message
    assert f"kubectl delete -n {SIM_NAMESPACE} pytorchjobs,experiments,trainjobs -l {RUN_ID_LABEL}={RUN}" in message


def test_under_kfp_local_there_is_nothing_to_clean_up(capsys):
    assert cleanup_after_run(RUN, environ={})["skipped"]
    assert "no cluster jobs" in capsys.readouterr().out


@pytest.mark.slow
def test_jobs_are_owned_by_the_runs_workflow_never_by_the_launcher_pod(
    sim, fake_cluster, fake_custom_api, fake_core_api, sim_volume, monkeypatch
):
    """A KFP retry replaces the launcher pod: a job owned by it would be garbage-collected with it,
    killing the training the retry should re-attach to. The Workflow (the pod's controller) lives
    across retries and goes with the run."""
    pod = "llm-finetune-x7k2p-system-container-impl-1"
    monkeypatch.setenv("KFP_POD_NAME", pod)
    fake_core_api.pods[SIM_NAMESPACE] = [
        client.V1Pod(metadata=client.V1ObjectMeta(name=pod, namespace=SIM_NAMESPACE, owner_references=[WORKFLOW]))
    ]
    plan = sim_plan(sim_volume, run_id=RUN)
    with pytest.raises(JobFailedPermanently):  # bad data: the job is created, then fails at once
        run_on_cluster(plan.job, plan.trainer.launch("/missing"), poll_s=0.2, cluster=fake_cluster,
                       print_fn=lambda _: None)  # fmt: skip
    (job,) = fake_custom_api.created("pytorchjobs")
    assert job["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "name": "llm-finetune-x7k2p",
            "uid": "wf-uid-1",
            "blockOwnerDeletion": False,
        }
    ]


def test_sigterm_to_the_sweep_launcher_deletes_its_experiment(
    sim, fake_cluster, fake_custom_api, sim_volume, tmp_path, monkeypatch
):
    """The sweep step's launcher, cancelled while it waits: the Experiment (and with it, through
    Katib's ownership, its trials) is deleted before the step exits 143. The Experiment carries the
    run-id label the exit handler finds."""
    from llmft.components.lib.jobs.katib_sweep import run_sweep_step
    from llmft.katib.experiment import GROUP, PLURAL, VERSION

    launcher = "llm-finetune-x7k2p-system-container-impl-3"
    monkeypatch.setenv("KFP_POD_NAME", launcher)
    sim.kfp_launcher(launcher, "llm-finetune-x7k2p", deadline_s=3600)

    plan = sim_plan(sim_volume, hpo=True, run_id=RUN, hpo_max_trials=2, hpo_parallel_trials=1,
                    hpo_max_failed_trials=1, hpo_overrides="space.lora_r.values=4,8")  # fmt: skip
    key = (GROUP, VERSION, SIM_NAMESPACE, PLURAL, plan.sweep.experiment)
    seen = {}

    def cancel_when_created() -> None:
        import time

        while key not in fake_custom_api.objects:
            time.sleep(0.1)
        seen["labels"] = dict(fake_custom_api.objects[key]["metadata"]["labels"])
        sim.cancel_run("llm-finetune-x7k2p")  # KFP's cancel: activeDeadlineSeconds 0, then Argo's SIGTERM

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the test: the sweep launcher did not handle it")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        threading.Thread(target=cancel_when_created, daemon=True).start()
        with pytest.raises(SystemExit) as stopped:
            run_sweep_step(plan, tokenized_dir=f"{sim_volume}/tokenized/demo", output_dir=str(tmp_path / "out"),
                           cluster=fake_cluster, poll_s=0.1)  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    assert key not in fake_custom_api.objects
    assert seen["labels"][RUN_ID_LABEL] == run_label(RUN)
