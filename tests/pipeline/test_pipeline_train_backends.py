"""The train step's two backends: `kubeflow` (PyTorchJob through the TrainingClient, against
fakes at the kubernetes-client boundary) and `local` (real torchrun subprocesses)."""

from __future__ import annotations

import pytest
from k8s_fakes import FakeCoreV1Api, FakeCustomObjectsApi
from llmft.components.lib.cluster import Cluster
from llmft.components.lib.deployment import crd_schema_errors
from llmft.components.lib.local_train import TrainingFailed, run_local_training, torchrun_command
from llmft.components.lib.params import TrainingParams, trainer_overrides
from llmft.components.lib.pytorchjob import TrainingJobFailed
from llmft.components.lib.train_job import job_name, run_on_cluster

NS = "team-a"
RUN_ID = "0f8e6a2c-1d2b-4c3e-9f00-123456789abc"
OVERRIDES = trainer_overrides(
    TrainingParams(model="Qwen/Qwen2.5-7B-Instruct", lora_r=16, max_steps=100),
    data_dir="/data/tokenized/abc",
    output_dir=f"/data/runs/{RUN_ID}",
)
NAME = job_name(RUN_ID)
MASTER = f"{NAME}-master-0"


def _condition(kind: str, message: str = "") -> dict:
    return {
        "type": kind,
        "status": "True",
        "reason": f"PyTorchJob{kind}",
        "message": message,
        "lastTransitionTime": "2026-11-26T10:00:00Z",
        "lastUpdateTime": "2026-11-26T10:00:00Z",
    }


def _operator(core: FakeCoreV1Api, outcome: str):
    """Script the Training Operator: Running with a master log, then ``outcome``."""
    labels = {"training.kubeflow.org/job-name": NAME, "training.kubeflow.org/job-role": "master"}

    def on_get(job: dict, count: int) -> None:
        status = job.setdefault("status", {"conditions": []})
        if count == 1:
            status["conditions"] = [_condition("Created"), _condition("Running")]
            core.add_pod(NS, MASTER, labels, log="step 10 loss=2.1\n")
        elif count == 2:
            if outcome == "Failed":
                core.append_log(
                    NS,
                    MASTER,
                    "Traceback (most recent call last):\n"
                    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB\n",
                )
            else:
                core.append_log(NS, MASTER, "eval_loss=1.9\nperplexity=6.7\n")
            status["conditions"].append(_condition(outcome, f"PyTorchJob {NAME} {outcome.lower()}"))

    return on_get


@pytest.fixture
def fakes():
    core = FakeCoreV1Api()
    custom = FakeCustomObjectsApi()
    return Cluster(NS, custom_api=custom, core_api=core), custom, core


def _run(cluster, **kwargs):
    return run_on_cluster(
        OVERRIDES,
        run_id=RUN_ID,
        num_workers=2,
        gpus_per_worker=8,
        pvc_name="llmft-data",
        timeout_s=5,
        poll_s=0.01,
        cluster=cluster,
        **kwargs,
    )


def test_succeeded_job_is_the_intended_pytorchjob(fakes, crd_dir):
    cluster, custom, core = fakes
    custom.on_get = _operator(core, "Succeeded")
    result = _run(cluster)
    assert result["succeeded"] and result["name"] == NAME
    (job,) = custom.created("pytorchjobs")
    assert crd_schema_errors(job, crd_dir / "kubeflow.org_pytorchjobs.yaml") == []
    assert job["spec"]["nprocPerNode"] == "8" and job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]
    assert master["restartPolicy"] == "ExitCode"
    pod = master["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["llmft"]
    assert container["args"][:2] == ["train", "--nproc"] and set(OVERRIDES) <= set(container["args"])
    assert {"name": "pvc-0", "mountPath": "/data"} in container["volumeMounts"]
    assert {"name": "pvc-0", "persistentVolumeClaim": {"claimName": "llmft-data"}} in pod["volumes"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"]["value"] == "/data/hf-cache"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True  # a Secret, never a value
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_failed_job_fails_the_step_with_the_masters_last_log_lines(fakes):
    cluster, custom, core = fakes
    custom.on_get = _operator(core, "Failed")
    with pytest.raises(TrainingJobFailed) as error:
        _run(cluster)
    assert "Failed" in str(error.value) and "CUDA out of memory" in str(error.value)


def test_tracking_uri_parameter_replaces_the_secret_key(fakes):
    cluster, custom, core = fakes
    custom.on_get = _operator(core, "Succeeded")
    _run(cluster, mlflow_tracking_uri="http://mlflow.mlflow:5000")
    env = {
        e["name"]: e
        for e in custom.created("pytorchjobs")[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"
        ][0]["env"]
    }
    assert env["MLFLOW_TRACKING_URI"] == {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.mlflow:5000"}


def test_a_retry_reuses_a_succeeded_job_and_replaces_any_other(fakes):
    cluster, custom, core = fakes
    custom.on_get = _operator(core, "Succeeded")
    _run(cluster)
    again = _run(cluster)  # the retried task finds its Succeeded job
    assert again["reused"] and len(custom.created("pytorchjobs")) == 1

    key = ("kubeflow.org", "v1", NS, "pytorchjobs", NAME)
    custom.objects[key]["status"] = {"conditions": [_condition("Failed")]}
    custom.gets.clear()
    core.pods.clear()
    _run(cluster)
    assert [c[0] for c in custom.calls if c[0] in ("create", "delete")] == ["create", "delete", "create"]


def test_job_names_are_stable_valid_and_distinct():
    assert job_name(RUN_ID) == job_name(RUN_ID) and len(job_name(RUN_ID)) <= 30
    assert job_name(RUN_ID) != job_name(RUN_ID[:-1] + "d")
    assert job_name("12345678").startswith("llmft-")


def test_local_backend_is_torchrun_of_the_same_trainer(tmp_path):
    command = torchrun_command(["lora.r=8"], nproc=2)
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "llmft.trainer",
        "lora.r=8",
    ]
    with pytest.raises(TrainingFailed) as error:  # a real torchrun + trainer, refusing a bad config
        run_local_training(
            ["lora.r=0", "model.name_or_path=x", "data=y", f"output_dir={tmp_path}"],
            log_path=tmp_path / "train.log",
            timeout_s=120,
        )
    assert "exited with code" in str(error.value) and "lora.r" in str(error.value)
    assert "lora.r" in (tmp_path / "train.log").read_text()
