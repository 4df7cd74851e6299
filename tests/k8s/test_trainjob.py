"""The TrainJob backend (Kubeflow Trainer v2.3): the job validated against the real CRDs and merged
onto the shipped runtimes the way the controller does (trainer_v2_sim.py cites the code), and run
through the Kubeflow SDK's backend against fakes at the kubernetes-client boundary."""

from __future__ import annotations

import dataclasses

import jsonschema
import pytest
import yaml
from trainer_v2_sim import build_jobset, load_runtime, make_plan, node_pods, strategic_merge

from llmft.components.lib.contracts.schema import DEFAULT_RUNTIME
from llmft.components.lib.jobs.pytorchjob_spec import ElasticSpec, build_job_spec, build_pytorchjob, pytorchjob_to_dict
from llmft.components.lib.jobs.trainjob_spec import (
    build_trainjob,
    parse_runtime_ref,
    trainjob_admission_errors,
    trainjob_to_dict,
)
from llmft.trainer.errors import ConfigError

DATA = "/data/tokenized/0123abcd"


def _crd_validator(crd_dir, filename: str):
    crd = yaml.load((crd_dir / filename).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    return lambda obj: [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


@pytest.fixture(scope="module")
def trainjob_crd_errors(crd_dir):
    return _crd_validator(crd_dir, "trainer.kubeflow.org_trainjobs.yaml")


@pytest.fixture(scope="module")
def runtime_crd_errors(crd_dir):
    return _crd_validator(crd_dir, "trainer.kubeflow.org_clustertrainingruntimes.yaml")


def _spec(**changes):
    plan = make_plan(training_backend="trainjob", **changes)
    return plan, build_job_spec(plan.job, plan.trainer.launch(DATA))


PLANS = {
    "one-gpu": {},
    "two-nodes-eight-gpus": {
        "training_workers": 2,
        "training_gpus_per_worker": 8,
        "gpu_node_selector": "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
        "hf_token_secret": "llmft-hf-token",
        "langfuse_secret": "llmft-langfuse",
    },
    "cpu": {"training_gpus_per_worker": 0, "training_cpu": "4", "training_memory": "16Gi"},
}


@pytest.mark.parametrize("changes", PLANS.values(), ids=PLANS.keys())
def test_trainjob_passes_the_crd_schema_and_the_trainer_admission_rules(changes, trainjob_crd_errors):
    _, spec = _spec(**changes)
    body = trainjob_to_dict(build_trainjob(spec))
    assert trainjob_crd_errors(body) == []
    assert trainjob_admission_errors(body) == []
    assert body["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": DEFAULT_RUNTIME,
    }


def test_the_trainjob_runs_the_plans_config_file_and_no_plan_setting():
    """Issue 26: the trainer reads the plan's resolved config.yaml; only tokenize's folder follows it."""
    plan, spec = _spec(finetune_lora_r=8, finetune_overrides="save_every=5")
    args = trainjob_to_dict(build_trainjob(spec))["spec"]["trainer"]["args"]
    assert args == ["train", "--nproc", "1", "--config", f"{plan.trainer.run_dir}/config.yaml", f"data={DATA}"]


@pytest.mark.harness
def test_shipped_runtimes_are_valid_cluster_training_runtimes(crd_dir, runtime_crd_errors):
    """Upstream's runtimes against upstream's schema: the fixtures the simulator merges our TrainJobs onto are what
    Kubeflow Trainer v2.3.0 ships (a harness check; llmft's reading of them: test_trainjob_runtime.py)."""
    for name in ("torch_distributed", "deepspeed_distributed"):
        assert runtime_crd_errors(load_runtime(crd_dir, name)) == [], name


@pytest.mark.parametrize("changes", PLANS.values(), ids=PLANS.keys())
def test_merged_onto_torch_distributed_the_node_pod_runs_what_the_pytorchjob_runs(changes, crd_dir, validate_pod):
    plan, spec = _spec(**changes)
    body = trainjob_to_dict(build_trainjob(spec, runtime=plan.job.runtime))
    master = pytorchjob_to_dict(build_pytorchjob(spec))["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    jobset = build_jobset(load_runtime(crd_dir, "torch_distributed"), body)
    pods = node_pods(jobset, body["metadata"]["name"], "team-a")
    assert len(pods) == plan.job.num_workers
    for rank, pod in enumerate(pods):
        node = pod["spec"]["containers"][0]
        pytorch = master["spec"]["containers"][0]
        assert (node["name"], node["image"], node["command"], node["args"]) == (
            "node",
            plan.job.image,
            pytorch["command"],
            pytorch["args"],
        )
        assert node["args"][:3] == ["train", "--nproc", str(max(plan.job.gpus_per_worker, 1))]
        assert node["resources"] == pytorch["resources"]
        env = {e["name"]: e for e in node["env"]}
        for var in pytorch["env"]:  # the HF caches, the MLflow URI, every Secret reference
            assert env[var["name"]] == var
        assert env["PET_NNODES"]["value"] == str(plan.job.num_workers)
        assert env["PET_NPROC_PER_NODE"]["value"] == str(max(plan.job.gpus_per_worker, 1))
        assert env["PET_MASTER_ADDR"]["value"] == f"{body['metadata']['name']}-node-0-0.{body['metadata']['name']}"
        mounts = {m["mountPath"]: m["name"] for m in node["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        assert volumes[mounts[plan.job.mount_path]]["persistentVolumeClaim"]["claimName"] == plan.job.pvc_name
        assert set(mounts.values()) <= set(volumes)
        for key in ("tolerations", "securityContext", "nodeSelector"):
            assert pod["spec"].get(key) == master["spec"].get(key), key
        assert (
            pod["metadata"]["labels"]["pipelines.kubeflow.org/run-id"]
            == plan.job.labels["pipelines.kubeflow.org/run-id"]
        )
        assert pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == str(rank)
        assert pod["spec"]["restartPolicy"] == "OnFailure"
        validate_pod(pod["metadata"], pod["spec"])
    trainer_job = next(r for r in jobset["replicatedJobs"] if r["name"] == "node")
    assert trainer_job["template"]["spec"]["parallelism"] == plan.job.num_workers


def test_on_deepspeed_distributed_the_command_lands_on_the_mpi_launcher_without_torchrun_env(crd_dir):
    """Why check_runtime refuses MPI runtimes: the trainer's command replaces the launcher's
    mpirun and no PET_* rendezvous is injected (mlPolicy.mpi, not torch)."""
    plan, spec = _spec(training_workers=2)
    body = trainjob_to_dict(build_trainjob(spec, runtime="deepspeed-distributed"))
    assert body["spec"]["runtimeRef"]["name"] == "deepspeed-distributed"
    jobset = build_jobset(load_runtime(crd_dir, "deepspeed_distributed"), body)
    jobs = {r["name"]: r["template"]["spec"] for r in jobset["replicatedJobs"]}
    launcher = jobs["launcher"]["template"]["spec"]["containers"][0]
    assert launcher["command"] == ["llmft"]
    node = jobs["node"]["template"]["spec"]["containers"][0]
    assert node["command"] == ["/usr/sbin/sshd"]  # the runtime's own, untouched by the trainer
    assert not any(e["name"].startswith("PET_") for e in launcher.get("env", []) + node.get("env", []))
    # the patch still reaches the `node` job's pods (volumes, mounts), as the controller merges by name
    assert {m["mountPath"] for m in node["volumeMounts"]} == {"/dev/shm", plan.job.mount_path}


def test_the_strategic_merge_keeps_runtime_fields_and_replaces_tolerations():
    base = {
        "containers": [{"name": "node", "image": "x", "volumeMounts": [{"name": "a", "mountPath": "/a"}]}],
        "tolerations": [{"key": "a"}],
        "nodeSelector": {"zone": "1"},
    }
    patch = {
        "containers": [{"name": "node", "volumeMounts": [{"name": "b", "mountPath": "/b"}]}],
        "tolerations": [{"key": "b"}],
        "nodeSelector": {"gpu": "h100"},
    }
    merged = strategic_merge(base, patch)
    assert merged["containers"] == [
        {
            "name": "node",
            "image": "x",
            "volumeMounts": [{"name": "a", "mountPath": "/a"}, {"name": "b", "mountPath": "/b"}],
        }
    ]
    assert merged["tolerations"] == [{"key": "b"}]
    assert merged["nodeSelector"] == {"zone": "1", "gpu": "h100"}


def test_the_builder_refuses_what_a_trainjob_cannot_express():
    _, spec = _spec(training_workers=2)
    with pytest.raises(ConfigError, match="fixed number of nodes"):
        build_trainjob(dataclasses.replace(spec, elastic=ElasticSpec(min_nodes=1, max_nodes=2)))
    with pytest.raises(ConfigError, match=r"\['PET_MASTER_ADDR'\] are set by the Trainer"):
        build_trainjob(dataclasses.replace(spec, env={**spec.env, "PET_MASTER_ADDR": "x"}))
    with pytest.raises(ConfigError, match="fits 63 characters"):  # aaa...-node-0-1-abcde: 49 + 15 = 64
        build_trainjob(dataclasses.replace(spec, name="a" * 49))
    build_trainjob(dataclasses.replace(spec, name="a" * 48))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("torch-distributed", ("ClusterTrainingRuntime", "torch-distributed")),
        ("TrainingRuntime/llmft-torch", ("TrainingRuntime", "llmft-torch")),
        ("ClusterTrainingRuntime/torch-distributed", ("ClusterTrainingRuntime", "torch-distributed")),
    ],
)
def test_runtime_references(value, expected):
    assert parse_runtime_ref(value) == expected


@pytest.mark.parametrize("value", ["", "Torch_Distributed", "Job/x", "TrainingRuntime/"])
def test_bad_runtime_references_name_the_fix(value):
    with pytest.raises(ConfigError, match="TrainingRuntime/NAME"):
        parse_runtime_ref(value)
    with pytest.raises(ConfigError, match="pipeline parameter `training_runtime`"):
        make_plan(training_backend="trainjob", training_runtime=value)


def test_admission_rules_catch_an_env_patch_of_the_node_container_and_a_bad_manager():
    _, spec = _spec()
    body = trainjob_to_dict(build_trainjob(spec))
    patch = body["spec"]["runtimePatches"][0]
    node = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    node["spec"]["containers"][0]["env"] = [{"name": "HF_TOKEN", "value": "x"}]
    patch["manager"] = "launcher"
    body["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "2"})
    problems = " | ".join(trainjob_admission_errors(body))
    assert "env of container 'node' goes in spec.trainer.env" in problems
    assert "domain-prefixed path" in problems
    assert "reserved envs ['PET_NNODES']" in problems


def test_a_misspelt_field_is_refused_not_dropped():
    from llmft.components.lib.jobs.trainjob_spec import parse_trainjob

    _, spec = _spec()
    body = trainjob_to_dict(build_trainjob(spec))
    body["spec"]["trainer"]["numNode"] = 2
    with pytest.raises(ConfigError, match="trainer.numNode"):
        parse_trainjob(body)
