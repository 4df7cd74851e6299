"""The train step's two backends: `pytorchjob` (PyTorchJob through the TrainingClient, against
fakes at the kubernetes-client boundary) and `local` (real torchrun subprocesses)."""

from __future__ import annotations

import pytest
from fake_clock import rfc3339_now
from k8s_fakes import FakeCoreV1Api, FakeCustomObjectsApi
from plan_helpers import RUN_ID, make_plan

from llmft.components.lib.cluster import Cluster
from llmft.components.lib.contracts.run_jobs import TrainingJobFailed, job_name
from llmft.components.lib.contracts.schema import TrainerLaunch
from llmft.components.lib.jobs.backends import run_on_cluster
from llmft.components.lib.jobs.local_train import TrainingFailed, run_local_training, train_command
from llmft.components.lib.serving.deployment import crd_schema_errors

NS = "team-a"
PLAN = make_plan(
    training_workers=2,
    training_gpus_per_worker=8,
    finetune_max_steps=100,
    training_timeout_s=5,
    hf_token_secret="llmft-hf-token",
    langfuse_secret="llmft-langfuse",
    training_cpu="30",
    training_memory="500Gi",
    gpu_node_selector="nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
    training_image="registry.example.com/ml/llmft-trainer:1.2.3",
)
LAUNCH = PLAN.trainer.launch("/data/tokenized/abc")
NAME = job_name(RUN_ID)
MASTER = f"{NAME}-master-0"


def _condition(kind: str, message: str = "") -> dict:
    return {
        "type": kind,
        "status": "True",
        "reason": f"PyTorchJob{kind}",
        "message": message,
        "lastTransitionTime": rfc3339_now(),
        "lastUpdateTime": rfc3339_now(),
    }


def _operator(core: FakeCoreV1Api, outcome: str):
    """Script the Training Operator: Running with a master log, then ``outcome``."""
    labels = {"training.kubeflow.org/job-name": NAME, "training.kubeflow.org/job-role": "master"}

    def on_get(job: dict, count: int) -> None:
        status = job.setdefault("status", {"conditions": []})
        if any(c["type"] in ("Succeeded", "Failed") for c in status.get("conditions", [])):
            return  # a finished job's conditions never change (kubeflow/trainer pkg/util/status.go 103-107)
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


def _run(cluster, plan=PLAN):
    return run_on_cluster(plan.job, plan.trainer.launch("/data/tokenized/abc"), poll_s=0.01, cluster=cluster)


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
    assert container["command"] == ["llmft"] and container["image"] == "registry.example.com/ml/llmft-trainer:1.2.3"
    # the plan's resolved config.yaml, then only what tokenize decided: no plan setting on the command line
    config = f"{PLAN.trainer.run_dir}/config.yaml"
    assert container["args"] == ["train", "--nproc", "8", "--config", config, "data=/data/tokenized/abc"]
    assert {"name": "pvc-0", "mountPath": "/data"} in container["volumeMounts"]
    assert {"name": "pvc-0", "persistentVolumeClaim": {"claimName": "llmft-data"}} in pod["volumes"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"]["value"] == "/data/hf-cache" and env["HF_HUB_CACHE"]["value"] == "/data/hf-cache/hub"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "llmft-hf-token", "key": "HF_TOKEN"}  # required
    assert env["LANGFUSE_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "llmft-langfuse"
    assert not [e for e in env.values() if e.get("valueFrom", {}).get("secretKeyRef", {}).get("optional")]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    resources = container["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": "8", "cpu": "30", "memory": "500Gi"}
    assert resources["requests"] == {"nvidia.com/gpu": "8", "cpu": "30", "memory": "500Gi"}


def test_failed_job_fails_the_step_with_the_masters_last_log_lines(fakes):
    cluster, custom, core = fakes
    custom.on_get = _operator(core, "Failed")
    with pytest.raises(TrainingJobFailed) as error:
        _run(cluster)
    assert "Failed" in str(error.value) and "CUDA out of memory" in str(error.value)


def test_tracking_uri_parameter_replaces_the_secret_key(fakes):
    cluster, custom, core = fakes
    custom.on_get = _operator(core, "Succeeded")
    _run(
        cluster,
        make_plan(training_timeout_s=5, mlflow_secret="llmft-mlflow", mlflow_tracking_uri="http://mlflow.mlflow:5000"),
    )
    env = {
        e["name"]: e
        for e in custom.created("pytorchjobs")[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"
        ][0]["env"]
    }
    assert env["MLFLOW_TRACKING_URI"] == {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.mlflow:5000"}


def test_a_retry_reuses_a_succeeded_job_and_replaces_one_that_did_not_fail_permanently(fakes):
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


@pytest.mark.slow
def test_the_local_backend_runs_the_command_of_a_job_replica(tmp_path):
    """`llmft train --nproc N`: the one launcher (SIGTERM -> 143), exactly what the PyTorchJob runs."""
    command = train_command(TrainerLaunch("/c.yaml", {"lora.r": 8}), nproc=2)
    assert command[1:] == ["-m", "llmft", "train", "--nproc", "2", "--config", "/c.yaml", "lora.r=8"]
    with pytest.raises(TrainingFailed) as error:  # a real torchrun + trainer, refusing a bad config
        run_local_training(
            TrainerLaunch(None, {"lora.r": 0, "model.name_or_path": "x", "data": "y", "output_dir": str(tmp_path)}),
            log_path=tmp_path / "train.log",
            timeout_s=120,
        )
    assert "`lora.r` must be > 0" in str(error.value)  # the trainer's one-line reason, not only an exit code
    assert "lora.r" in (tmp_path / "train.log").read_text()
