"""Every PyTorchJob variant the builder makes is admitted: the real CRD schema, the
operator's webhook rules, and kubernetes-validate for the pod template."""

from __future__ import annotations

import copy

import pytest

from llmft.components import images
from llmft.components.lib.contracts.pod_parts import DEFAULT_SECRET_ENVS, PvcMount, SecretEnv, Toleration
from llmft.components.lib.jobs.katib_trial import trial_pytorchjob_dict
from llmft.components.lib.jobs.pytorchjob_spec import (
    ElasticSpec,
    JobSpec,
    build_pytorchjob,
    pytorchjob_to_dict,
    pytorchjob_webhook_errors,
    trainer_command,
)
from llmft.trainer.errors import ConfigError

DATA = PvcMount("llmft-data", "/mnt/data")
VARIANTS = {
    "one-node-cpu": JobSpec(name="ft-cpu", overrides={"max_steps": 5}),
    "one-node-gpu": JobSpec(
        name="ft-1x8",
        gpus_per_node=8,
        cpu="32",
        memory="256Gi",
        pvcs=(DATA,),
        config_path="/mnt/data/configs/qwen7b.yaml",
        overrides={"lora.r": 16},
    ),
    "multi-node": JobSpec(
        name="ft-2x8",
        num_nodes=4,
        gpus_per_node=8,
        memory="512Gi",
        pvcs=(DATA, PvcMount("hf-cache", "/mnt/hf", sub_path="cache", read_only=True)),
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        tolerations=(Toleration("nvidia.com/gpu"), Toleration("dedicated", "Equal", "ml", "NoExecute")),
        env={"NCCL_DEBUG": "WARN"},
        labels={"kueue.x-k8s.io/queue-name": "gpu"},
    ),
    "elastic": JobSpec(
        name="ft-elastic", num_nodes=3, gpus_per_node=4, elastic=ElasticSpec(min_nodes=2, max_nodes=4, max_restarts=5)
    ),
    "no-secrets": JobSpec(
        name="ft-nosecret",
        secret_envs=(),
        run_as_user=None,
        active_deadline_seconds=None,
        clean_pod_policy="All",
        ttl_seconds_after_finished=3600,
        nproc_per_node="auto",
    ),
    "custom-secret": JobSpec(
        name="ft-secret",
        secret_envs=(SecretEnv("HF_TOKEN", "my-hf", "token", False),),
        image_pull_secrets=("regcred",),
        service_account="pipeline-runner",
    ),
}


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    spec = VARIANTS[request.param]
    return spec, pytorchjob_to_dict(build_pytorchjob(spec))


def test_every_variant_passes_crd_schema_and_webhook(variant, pytorchjob_crd_errors):
    _, job = variant
    assert pytorchjob_crd_errors(job) == []
    assert pytorchjob_webhook_errors(job) == []


def test_every_pod_template_is_a_valid_core_pod(variant, validate_pod):
    _, job = variant
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        validate_pod(replica["template"]["metadata"], replica["template"]["spec"])


@pytest.mark.parametrize(
    "field, value",
    [("resources", {"limits": {"memory": ["64Gi"]}}), ("imagePullPolicy", 3), ("imagePullPolicyy", "Always")],
)
def test_pod_validation_rejects_bad_and_unknown_fields(validate_pod, field, value):
    import kubernetes_validate

    job = pytorchjob_to_dict(build_pytorchjob(VARIANTS["one-node-gpu"]))
    template = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    template["spec"]["containers"][0][field] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_pod(template["metadata"], template["spec"])


def test_replicas_command_and_resources(variant):
    spec, job = variant
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    assert replicas.get("Worker", {}).get("replicas", 0) == spec.num_nodes - 1
    assert isinstance(job["spec"]["nprocPerNode"], str)
    for replica in replicas.values():
        assert replica["restartPolicy"] == "ExitCode"
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["image"] == images.TRAINER_IMAGE
        assert container["command"] == ["llmft"]
        assert container["args"][:3] == ["train", "--nproc", job["spec"]["nprocPerNode"]]
        gpus = (container["resources"].get("limits") or {}).get("nvidia.com/gpu")
        assert gpus == (str(spec.gpus_per_node) if spec.gpus_per_node else None)
        assert (container["resources"].get("requests") or {}).get("nvidia.com/gpu") == gpus
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert "/dev/shm" in mounts and all(p.mount_path in mounts for p in spec.pvcs)


def test_gpu_job_tolerates_gpu_taint_and_cpu_job_does_not():
    gpu = pytorchjob_to_dict(build_pytorchjob(VARIANTS["one-node-gpu"]))
    cpu = pytorchjob_to_dict(build_pytorchjob(VARIANTS["one-node-cpu"]))
    pod = gpu["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "tolerations" not in cpu["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert gpu["spec"]["nprocPerNode"] == "8" and cpu["spec"]["nprocPerNode"] == "1"


def test_secrets_are_secret_key_refs_and_optional():
    job = pytorchjob_to_dict(build_pytorchjob(VARIANTS["one-node-gpu"]))
    env = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    by_name = {e["name"]: e for e in env}
    assert set(by_name) == {s.env_name for s in DEFAULT_SECRET_ENVS}
    for secret in DEFAULT_SECRET_ENVS:
        entry = by_name[secret.env_name]
        assert "value" not in entry, "a credential must never be a literal value"
        assert entry["valueFrom"]["secretKeyRef"] == {"name": secret.secret_name, "key": secret.key, "optional": True}
    no_secrets = pytorchjob_to_dict(build_pytorchjob(VARIANTS["no-secrets"]))
    assert "env" not in no_secrets["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def test_elastic_policy_never_carries_nproc():
    job = pytorchjob_to_dict(build_pytorchjob(VARIANTS["elastic"]))
    assert job["spec"]["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4, "maxRestarts": 5, "rdzvBackend": "c10d"}
    assert job["spec"]["nprocPerNode"] == "4"
    assert "Worker" in job["spec"]["pytorchReplicaSpecs"]


def test_overrides_render_as_yaml_values_in_order():
    spec = JobSpec(
        name="x",
        config_path="/c.yaml",
        overrides={
            "lr": 2e-4,
            "lora.r": 16,
            "gradient_checkpointing": False,
            "lora.target_modules": ["q_proj", "v_proj"],
            "resume": None,
            "data": "/mnt/data/tok",
        },
    )
    command, args = trainer_command(spec)
    assert command == ["llmft"]
    assert args == [
        "train",
        "--nproc",
        "1",
        "--config",
        "/c.yaml",
        "lr=0.0002",
        "lora.r=16",
        "gradient_checkpointing=false",
        "lora.target_modules=[q_proj,v_proj]",
        "resume=null",
        "data=/mnt/data/tok",
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"name": "Bad_Name"}, "DNS-1035"),
        ({"name": "a" * 60, "num_nodes": 2}, "63 characters"),
        ({"num_nodes": 0}, "num_nodes"),
        ({"nproc_per_node": "two"}, "nproc_per_node"),
        ({"gpus_per_node": 2, "nproc_per_node": "4"}, "exceeds gpus_per_node"),
        ({"memory": "lots"}, "memory"),
        ({"restart_policy": "Sometimes"}, "restart_policy"),
        ({"clean_pod_policy": "Some"}, "clean_pod_policy"),
        ({"backoff_limit": -1}, "backoff_limit"),
        ({"elastic": ElasticSpec(1, 2)}, "num_nodes >= 2"),
        ({"num_nodes": 3, "elastic": ElasticSpec(4, 5)}, "min_nodes"),
        ({"pvcs": (PvcMount("data", "relative/path"),)}, "absolute"),
        ({"pvcs": (PvcMount("data", "/dev/shm"),)}, "distinct"),
        ({"env": {"HF_TOKEN": "x"}}, "set twice"),
        ({"overrides": {"bad key": 1}}, "dotted name"),
        ({"overrides": {"prompt": "a\nb"}}, "newline"),
    ],
)
def test_bad_specs_fail_before_the_cluster_with_the_field_named(change, message):
    spec = JobSpec(**{"name": "ok", **change})
    with pytest.raises(ConfigError, match=message):
        build_pytorchjob(spec)


def _valid_job() -> dict:
    return pytorchjob_to_dict(build_pytorchjob(VARIANTS["multi-node"]))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"].update(
                Chief=copy.deepcopy(j["spec"]["pytorchReplicaSpecs"]["Worker"])
            ),
            "Master or Worker",
        ),
        (lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2), "exactly one Master"),
        (lambda j: j["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas=0), "at least 1"),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].update(
                name="main"
            ),
            "named 'pytorch'",
        ),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].pop("image"),
            "image",
        ),
        (
            lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"].update(containers=[]),
            "must be specified",
        ),
        (lambda j: j["spec"].update(nprocPerNode=8), "must be a string"),
        (lambda j: j["spec"].update(elasticPolicy={"nProcPerNode": 8}), "must not be used with spec.nprocPerNode"),
        (
            lambda j: (
                j["spec"].update(elasticPolicy={"minReplicas": 1}),
                j["spec"]["pytorchReplicaSpecs"].pop("Worker"),
            ),
            "required with an elastic policy",
        ),
        (lambda j: j["metadata"].update(name="Not.A.Label"), "DNS-1035"),
        (lambda j: j["spec"].pop("pytorchReplicaSpecs"), "required"),
    ],
)
def test_webhook_rules_reject_what_the_operator_rejects(mutate, message):
    job = _valid_job()
    assert pytorchjob_webhook_errors(job) == []
    mutate(job)
    errors = pytorchjob_webhook_errors(job)
    assert any(message in e for e in errors), errors


@pytest.mark.harness
def test_crd_schema_catches_type_errors(pytorchjob_crd_errors):
    """The validator every PyTorchJob test relies on does reject a wrong type (a harness check: a validator that
    accepted everything would make those tests pass vacuously)."""
    job = _valid_job()
    job["spec"]["runPolicy"]["backoffLimit"] = "three"
    job["spec"]["nprocPerNode"] = 8
    errors = pytorchjob_crd_errors(job)
    assert any("backoffLimit" in e for e in errors) and any("nprocPerNode" in e for e in errors)


def test_trial_template_has_no_name_and_keeps_katib_placeholders(pytorchjob_crd_errors):
    spec = JobSpec(
        name="trial",
        num_nodes=2,
        gpus_per_node=1,
        pvcs=(DATA,),
        config_path="/mnt/data/configs/sweep.yaml",
        overrides={
            "lr": "${trialParameters.learningRate}",
            "lora.r": "${trialParameters.loraRank}",
            "output_dir": "/mnt/data/sweeps/${trialSpec.Name}",
        },
    )
    trial = trial_pytorchjob_dict(spec)
    assert "name" not in trial["metadata"] and "namespace" not in trial["metadata"]
    for replica in ("Master", "Worker"):  # every replica runs the signal-keeping script (katib_trial_script)
        container = trial["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]
        words = container["args"][0].split()
        assert container["command"] == ["sh", "-c"] and len(container["args"]) == 1
        assert "lr=${trialParameters.learningRate}" in words and "lora.r=${trialParameters.loraRank}" in words
    assert pytorchjob_crd_errors(trial) == [] and pytorchjob_webhook_errors(trial) == []


def test_trial_template_refuses_arguments_that_break_the_metrics_collector_shell():
    spec = JobSpec(name="trial", overrides={"run_name": "my run; rm -rf /"})
    with pytest.raises(ConfigError, match="shell"):
        trial_pytorchjob_dict(spec)


def test_fs_group_changes_ownership_only_on_a_root_mismatch(variant):
    """Beside fsGroup, fsGroupChangePolicy OnRootMismatch (Kubernetes >= 1.23 GA, k8s.io/api core/v1
    types.go PodFSGroupChangePolicy): without it (Always) the kubelet's volume ownership code
    (pkg/volume/volume_linux.go SetVolumeOwnership) walks and chowns the whole volume, every checkpoint
    and cache file, at every pod start of a volume type that manages ownership."""
    spec, job = variant
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        security = replica["template"]["spec"].get("securityContext")
        if spec.run_as_user is None:
            assert security is None
        else:
            assert security["fsGroup"] == spec.run_as_user
            assert security["fsGroupChangePolicy"] == "OnRootMismatch"
