"""Build and validate the trainer's PyTorchJob (Training Operator v1, kubeflow.org/v1).

``build_pytorchjob(JobSpec)`` returns the SDK model ``KubeflowOrgV1PyTorchJob``:
one Master plus ``num_nodes - 1`` Workers, each running
``llmft train --nproc N --config FILE key=value ...`` (torchrun -m llmft.trainer underneath)
in a container named ``pytorch``.
The operator injects the rendezvous environment (MASTER_ADDR/PORT, WORLD_SIZE, RANK,
PET_*), which torchrun reads, so the command carries no node arithmetic.

Exit codes follow restartPolicy ExitCode: the trainer exits 1 on bad config/data
(permanent, never retried) and 143 after SIGTERM (retryable: the pod restarts and
resumes from the last committed checkpoint).

The same job as a Katib trial template (a plain dict, its command wrapped for Katib's metrics
collector) is built in jobs/katib_trial.py; jobs/pytorchjob_launch.py submits the job through the
TrainingClient and waits for it; jobs/pytorchjob_logs.py follows its master's log.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmft.components import images
from llmft.components.lib.cluster import PYTORCHJOB_CONTAINER
from llmft.components.lib.contracts.pod_parts import (
    DEFAULT_SECRET_ENVS,
    GPU_TOLERATION,
    PvcMount,
    SecretEnv,
    Toleration,
)
from llmft.katib.k8s_names import is_k8s_name
from llmft.katib.trial_kinds import PYTORCHJOB_RESOURCE
from llmft.trainer.command_line import format_override_value, train_arguments
from llmft.trainer.errors import ConfigError

GROUP, VERSION, PLURAL, KIND = RESOURCE = PYTORCHJOB_RESOURCE  # written once: llmft/katib/trial_kinds.py
MASTER_PORT = 23456
"""Port the operator's rendezvous uses (its default, named ``pytorchjob-port``)."""
PORT_NAME = "pytorchjob-port"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"

RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CLEAN_POD_POLICIES = ("None", "Running", "All")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NPROC = re.compile(r"^(auto|cpu|gpu|[1-9][0-9]*)$")
_QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


@dataclass(frozen=True)
class ElasticSpec:
    """Torch elastic training (c10d rendezvous); nodes may join or leave between min and max."""

    min_nodes: int
    """Fewest nodes (Master + Workers) training continues with."""
    max_nodes: int
    """Most nodes the job scales up to."""
    max_restarts: int = 3
    """Worker-group restarts torchrun allows before failing."""
    rdzv_backend: str = "c10d"
    """Rendezvous backend (the operator supports c10d)."""


@dataclass(frozen=True)
class JobSpec:
    """Everything that varies between the training jobs of this project, whatever the backend (a PyTorchJob, a
    TrainJob, a Katib trial of either): image, resources, Secrets, volume, the trainer command. Named
    PyTorchJobSpec until issue 48 (the PyTorchJob was its first user)."""

    name: str
    """Job name: a DNS-1035 label (lowercase letters, digits, '-'), short enough for pod names."""
    namespace: str | None = None
    """Namespace (None = the Cluster's namespace when submitted)."""
    image: str = field(default_factory=lambda: images.TRAINER_IMAGE)
    """Trainer image (llmft/components/images.py; override with LLMFT_TRAINER_IMAGE)."""
    config_path: str | None = None
    """Trainer YAML inside the container (on the PVC or shipped in the image); None = defaults."""
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """``key=value`` overrides passed to the trainer, e.g. ``{"lora.r": 16}``."""
    num_nodes: int = 1
    """Pods: one Master plus ``num_nodes - 1`` Workers."""
    gpus_per_node: int = 0
    """``nvidia.com/gpu`` requested and limited per pod (0 = CPU job)."""
    nproc_per_node: str | None = None
    """Processes per pod (a string: digits, auto, cpu or gpu); None = gpus_per_node, or 1 on CPU."""
    cpu: str | None = None
    """CPU request per pod, e.g. ``"8"`` (None = unset)."""
    cpu_limit: str | None = None
    """CPU limit per pod (None = unset)."""
    memory: str | None = None
    """Memory request and limit per pod, e.g. ``"64Gi"`` (None = unset)."""
    shm_size: str = "8Gi"
    """Size limit of the in-memory /dev/shm NCCL and DataLoader workers need."""
    pvcs: tuple[PvcMount, ...] = ()
    """PVCs for data, checkpoints and the model cache."""
    secret_envs: tuple[SecretEnv, ...] = DEFAULT_SECRET_ENVS
    """Environment variables read from Secrets (HF token, MLflow, Langfuse)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Plain environment variables (never credentials)."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """Node labels the pods must match, e.g. ``{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}``."""
    tolerations: tuple[Toleration, ...] | None = None
    """Pod tolerations; None = tolerate ``nvidia.com/gpu`` taints when GPUs are requested."""
    restart_policy: str = "ExitCode"
    """Replica restart policy; ExitCode retries 128-255 (preemption) and fails fast on 1-127."""
    backoff_limit: int = 3
    """Pod restarts before the job is marked Failed."""
    active_deadline_seconds: int | None = 24 * 3600
    """Wall-clock limit of the whole job (None = unlimited); the default is the pipelines' ``training_timeout_s``."""
    ttl_seconds_after_finished: int | None = None
    """Delete the finished job after this many seconds (None = keep)."""
    clean_pod_policy: str = "None"
    """Pods deleted when the job ends: None (keep all, logs stay readable), Running or All."""
    elastic: ElasticSpec | None = None
    """Torch elastic policy (needs num_nodes >= 2); None = fixed size."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Extra labels of the job and its pods (e.g. a Kueue queue label)."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Extra pod annotations."""
    service_account: str | None = None
    """Service account of the pods (None = the namespace default)."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets for pulling a private trainer image."""
    run_as_user: int | None = images.IMAGE_UID
    """UID the pods run as (the trainer image's non-root user); None = image default."""
    termination_grace_s: int | None = None
    """Seconds a pod may take to stop after SIGTERM, to commit its checkpoint (None = Kubernetes' 30 s; the plan
    sizes it from the checkpoint: llmft/components/lib/jobs/grace.py)."""


def _spec_errors(spec: JobSpec) -> list[str]:
    errors = []
    longest_pod = f"{spec.name}-worker-{max(spec.num_nodes - 2, 0)}"
    if not is_k8s_name(spec.name, kind="dns1035") or len(longest_pod) > 63:
        errors.append(
            f"name {spec.name!r}: must be a DNS-1035 label (a-z, 0-9, '-', starting with a letter) "
            f"and short enough that pod name {longest_pod!r} fits 63 characters"
        )
    if spec.num_nodes < 1:
        errors.append(f"num_nodes={spec.num_nodes}: must be at least 1")
    if spec.gpus_per_node < 0:
        errors.append(f"gpus_per_node={spec.gpus_per_node}: must be 0 or more")
    nproc = resolved_nproc(spec)
    if not _NPROC.match(nproc):
        errors.append(f"nproc_per_node={nproc!r}: must be a positive integer string, 'auto', 'cpu' or 'gpu'")
    elif nproc.isdigit() and spec.gpus_per_node and int(nproc) > spec.gpus_per_node:
        errors.append(f"nproc_per_node={nproc} exceeds gpus_per_node={spec.gpus_per_node}: one process per GPU")
    for what, value in (
        ("cpu", spec.cpu),
        ("cpu_limit", spec.cpu_limit),
        ("memory", spec.memory),
        ("shm_size", spec.shm_size),
    ):
        if value is not None and not _QUANTITY.match(str(value)):
            errors.append(f"{what}={value!r}: not a Kubernetes quantity (e.g. '8', '500m', '64Gi')")
    if spec.restart_policy not in RESTART_POLICIES:
        errors.append(f"restart_policy={spec.restart_policy!r}: must be one of {RESTART_POLICIES}")
    if spec.clean_pod_policy not in CLEAN_POD_POLICIES:
        errors.append(f"clean_pod_policy={spec.clean_pod_policy!r}: must be one of {CLEAN_POD_POLICIES}")
    for what, number in (
        ("backoff_limit", spec.backoff_limit),
        ("active_deadline_seconds", spec.active_deadline_seconds),
        ("ttl_seconds_after_finished", spec.ttl_seconds_after_finished),
    ):
        if number is not None and number < 0:
            errors.append(f"{what}={number}: must not be negative")
    errors += _elastic_errors(spec) + _volume_and_env_errors(spec) + _override_errors(spec.overrides)
    return errors


def _elastic_errors(spec: JobSpec) -> list[str]:
    el = spec.elastic
    if el is None:
        return []
    errors = []
    if spec.num_nodes < 2:
        errors.append("elastic: needs num_nodes >= 2 (the operator requires a Worker replica with an elastic policy)")
    if not 1 <= el.min_nodes <= spec.num_nodes <= el.max_nodes:
        errors.append(
            f"elastic: need 1 <= min_nodes ({el.min_nodes}) <= num_nodes ({spec.num_nodes}) "
            f"<= max_nodes ({el.max_nodes})"
        )
    if el.max_restarts < 0:
        errors.append(f"elastic.max_restarts={el.max_restarts}: must not be negative")
    return errors


def _volume_and_env_errors(spec: JobSpec) -> list[str]:
    errors = []
    paths = [p.mount_path for p in spec.pvcs] + ["/dev/shm"]
    for pvc in spec.pvcs:
        if not is_k8s_name(pvc.claim_name, kind="subdomain"):
            errors.append(f"pvcs: claim name {pvc.claim_name!r} is not a valid PVC name")
        if not pvc.mount_path.startswith("/"):
            errors.append(f"pvcs: mount path {pvc.mount_path!r} of {pvc.claim_name!r} must be absolute")
    if len(set(paths)) != len(paths):
        errors.append(f"pvcs: mount paths must be distinct (and not /dev/shm): {paths}")
    names = [s.env_name for s in spec.secret_envs] + list(spec.env)
    for s in spec.secret_envs:
        if not (
            _ENV_NAME.match(s.env_name) and is_k8s_name(s.secret_name, kind="subdomain") and _SECRET_KEY.match(s.key)
        ):
            errors.append(f"secret_envs: {s} has an invalid env name, Secret name or key")
    for name in spec.env:
        if not _ENV_NAME.match(name):
            errors.append(f"env: {name!r} is not a valid environment variable name")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        errors.append(f"env: variables set twice: {duplicates}")
    return errors


def _override_errors(overrides: Mapping[str, Any]) -> list[str]:
    errors = []
    for key, value in overrides.items():
        if not _OVERRIDE_KEY.match(str(key)):
            errors.append(f"overrides: key {key!r} must be a dotted name like 'lora.r'")
        if "\n" in format_override_value(value):
            errors.append(f"overrides: value of {key!r} contains a newline")
    return errors


def resolved_nproc(spec: JobSpec) -> str:
    """``nprocPerNode`` as the operator wants it: a string."""
    if spec.nproc_per_node is not None:
        return str(spec.nproc_per_node)
    return str(spec.gpus_per_node) if spec.gpus_per_node > 0 else "1"


def trainer_command(spec: JobSpec) -> tuple[list[str], list[str]]:
    """(command, args) of the ``pytorch`` container.

    ``llmft train --nproc N`` starts ``torchrun --nproc-per-node=N -m llmft.trainer ...`` as its
    child and waits for it; torchrun reads nodes, ranks and the master address from the PET_* variables the
    operator injects. The wrapper exists for one reason: torchrun itself exits 1 when
    SIGTERM stops its ranks, which the ExitCode restart policy treats as permanent;
    ``llmft train`` forwards the signal, lets the ranks commit a checkpoint, and
    exits 143 so the operator restarts the pod and the trainer resumes. Exec form
    (no shell), so the signal reaches it as PID 1.
    """
    return ["llmft"], train_arguments(
        nproc=resolved_nproc(spec), config_path=spec.config_path, overrides=spec.overrides.items()
    )


def _env(spec: JobSpec) -> list:
    from kubernetes import client as k8s  # heavy: kubernetes

    env = [k8s.V1EnvVar(name=name, value=str(value)) for name, value in spec.env.items()]
    for s in spec.secret_envs:
        ref = k8s.V1SecretKeySelector(name=s.secret_name, key=s.key, optional=s.optional or None)
        env.append(k8s.V1EnvVar(name=s.env_name, value_from=k8s.V1EnvVarSource(secret_key_ref=ref)))
    return env


def _resources(spec: JobSpec):
    from kubernetes import client as k8s  # heavy: kubernetes

    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if spec.cpu:
        requests["cpu"] = str(spec.cpu)
    if spec.cpu_limit:
        limits["cpu"] = str(spec.cpu_limit)
    if spec.memory:
        requests["memory"] = limits["memory"] = str(spec.memory)
    if spec.gpus_per_node:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(spec.gpus_per_node)
    return k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None)


def _volumes(spec: JobSpec) -> tuple[list, list]:
    from kubernetes import client as k8s  # heavy: kubernetes

    volumes = [
        k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=spec.shm_size))
    ]
    mounts = [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
    for i, pvc in enumerate(spec.pvcs):
        name = f"pvc-{i}"
        volumes.append(
            k8s.V1Volume(
                name=name,
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                    claim_name=pvc.claim_name, read_only=pvc.read_only or None
                ),
            )
        )
        mounts.append(
            k8s.V1VolumeMount(
                name=name, mount_path=pvc.mount_path, sub_path=pvc.sub_path or None, read_only=pvc.read_only or None
            )
        )
    return volumes, mounts


def _tolerations(spec: JobSpec) -> list:
    from kubernetes import client as k8s  # heavy: kubernetes

    chosen = spec.tolerations if spec.tolerations is not None else ((GPU_TOLERATION,) if spec.gpus_per_node else ())
    return [k8s.V1Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect) for t in chosen]


def pod_template(spec: JobSpec):
    """The ``V1PodTemplateSpec`` every replica runs (also validated on its own as a Pod)."""
    from kubernetes import client as k8s  # heavy: kubernetes

    command, args = trainer_command(spec)
    volumes, mounts = _volumes(spec)
    container = k8s.V1Container(
        name=PYTORCHJOB_CONTAINER,
        image=spec.image,
        image_pull_policy="IfNotPresent",
        command=command,
        args=args,
        env=_env(spec) or None,
        resources=_resources(spec),
        volume_mounts=mounts,
        ports=[k8s.V1ContainerPort(name=PORT_NAME, container_port=MASTER_PORT, protocol="TCP")],
    )
    security = None
    if spec.run_as_user is not None:
        # OnRootMismatch: the kubelet chowns the volume only when its root's owner differs; the default
        # (Always) walks and chowns the whole volume at every pod start (checkpoints, caches: minutes).
        security = k8s.V1PodSecurityContext(
            run_as_non_root=spec.run_as_user != 0,
            run_as_user=spec.run_as_user,
            fs_group=spec.run_as_user,
            fs_group_change_policy="OnRootMismatch",
        )
    labels = {"app.kubernetes.io/part-of": "kfp-llm-finetune", "app.kubernetes.io/component": "trainer", **spec.labels}
    annotations = {"sidecar.istio.io/inject": "false", **spec.annotations}
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=labels, annotations=annotations),
        spec=k8s.V1PodSpec(
            containers=[container],
            volumes=volumes,
            node_selector=dict(spec.node_selector) or None,
            tolerations=_tolerations(spec) or None,
            service_account_name=spec.service_account,
            image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in spec.image_pull_secrets] or None,
            security_context=security,
            termination_grace_period_seconds=spec.termination_grace_s,
        ),
    )


def build_pytorchjob(spec: JobSpec):
    """The PyTorchJob for ``spec`` (``KubeflowOrgV1PyTorchJob``); raises ConfigError, listing
    every problem, before anything reaches the cluster."""
    from kubeflow.training import models  # heavy: kubeflow
    from kubernetes import client as k8s  # heavy: kubernetes

    errors = _spec_errors(spec)
    if errors:
        raise ConfigError(f"PyTorchJob {spec.name!r}: " + "; ".join(errors))
    replicas = {
        "Master": models.KubeflowOrgV1ReplicaSpec(
            replicas=1, restart_policy=spec.restart_policy, template=pod_template(spec)
        )
    }
    if spec.num_nodes > 1:
        replicas["Worker"] = models.KubeflowOrgV1ReplicaSpec(
            replicas=spec.num_nodes - 1, restart_policy=spec.restart_policy, template=pod_template(spec)
        )
    elastic = None
    if spec.elastic is not None:  # nprocPerNode stays at spec level: never elasticPolicy.nProcPerNode
        elastic = models.KubeflowOrgV1ElasticPolicy(
            min_replicas=spec.elastic.min_nodes,
            max_replicas=spec.elastic.max_nodes,
            max_restarts=spec.elastic.max_restarts,
            rdzv_backend=spec.elastic.rdzv_backend,
        )
    run_policy = models.KubeflowOrgV1RunPolicy(
        backoff_limit=spec.backoff_limit,
        active_deadline_seconds=spec.active_deadline_seconds,
        clean_pod_policy=spec.clean_pod_policy,
        ttl_seconds_after_finished=spec.ttl_seconds_after_finished,
    )
    job = models.KubeflowOrgV1PyTorchJob(
        api_version=f"{GROUP}/{VERSION}",
        kind=KIND,
        metadata=k8s.V1ObjectMeta(
            name=spec.name,
            namespace=spec.namespace,
            labels={"app.kubernetes.io/part-of": "kfp-llm-finetune", **spec.labels},
        ),
        spec=models.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=resolved_nproc(spec),
            pytorch_replica_specs=replicas,
            run_policy=run_policy,
            elastic_policy=elastic,
        ),
    )
    problems = pytorchjob_webhook_errors(pytorchjob_to_dict(job))
    if problems:  # a bug in this builder, not in the spec
        raise ConfigError(f"PyTorchJob {spec.name!r} would be rejected by the operator: " + "; ".join(problems))
    return job


def pytorchjob_to_dict(job) -> dict:
    """The job as the API server sees it (camelCase keys, no None values)."""
    from kubeflow.training.api_client import ApiClient  # heavy: kubeflow

    return ApiClient().sanitize_for_serialization(job)


def pytorchjob_webhook_errors(job: dict) -> list[str]:
    """The Training Operator's admission rules for PyTorchJob (validating webhook,
    kubeflow/training-operator v1.9 pkg/webhooks/pytorch/pytorchjob_webhook.go), which the
    CRD schema does not express. Empty list = admitted. ``metadata.name`` is checked only
    when present (a Katib trial template has none)."""
    errors = []
    name = (job.get("metadata") or {}).get("name")
    if name is not None and not is_k8s_name(name, kind="dns1035"):
        errors.append(f"metadata.name {name!r}: must be a DNS-1035 label")
    spec = job.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs")
    if not replicas:
        return errors + ["spec.pytorchReplicaSpecs: required"]
    for rtype, rspec in replicas.items():
        path = f"spec.pytorchReplicaSpecs[{rtype}]"
        if rtype not in ("Master", "Worker"):
            errors.append(f"{path}: replica type must be Master or Worker")
        containers = (((rspec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            errors.append(f"{path}.template.spec.containers: must be specified")
        if any(not c.get("image") for c in containers):
            errors.append(f"{path}: every container needs an image")
        if not any(c.get("name") == PYTORCHJOB_CONTAINER for c in containers):
            errors.append(f"{path}: needs a container named {PYTORCHJOB_CONTAINER!r}")
        count = (rspec or {}).get("replicas")
        if rtype == "Master" and count != 1:
            errors.append(f"{path}.replicas: must be 1 (exactly one Master)")
        if rtype == "Worker" and count is not None and count < 1:
            errors.append(f"{path}.replicas: must be at least 1")
    if "nprocPerNode" in spec and not isinstance(spec["nprocPerNode"], str):
        errors.append("spec.nprocPerNode: must be a string")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            errors.append("spec.pytorchReplicaSpecs[Worker]: required with an elastic policy")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errors.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    return errors


# --- a JobPlan's PyTorchJob ------------------------------------------------------------------


def build_job_spec(job, launch, *, name: str | None = None, namespace: str | None = None):
    """The PyTorchJob spec of ``job`` (a JobPlan) running the trainer as ``launch`` says (a TrainerLaunch:
    ``--config`` the plan's config.yaml, then the ``key=value`` decided after the plan).

    Every Secret key the plan names is a required reference (no ``optional``): a missing one is
    named by the plan step's preflight, not discovered by a pod stuck in CreateContainerConfigError.
    ``activeDeadlineSeconds`` is the plan's job timeout; ``cleanPodPolicy: Running`` deletes the
    Workers still running when the job fails, so they free their GPUs."""
    secret_envs = tuple(SecretEnv(key, s.name, key, optional=False) for s in job.secrets for key in s.keys)
    return JobSpec(
        name=name or job.name,
        namespace=namespace or None,
        image=job.image,
        config_path=launch.config_path,
        overrides=dict(launch.overrides),
        num_nodes=job.num_workers,
        gpus_per_node=job.gpus_per_worker,
        cpu=job.resources.cpu,
        cpu_limit=job.resources.cpu,
        memory=job.resources.memory,
        pvcs=(PvcMount(job.pvc_name, job.mount_path),),
        secret_envs=secret_envs,
        env=dict(job.env),
        node_selector=dict(job.node_selector),
        labels=dict(job.labels),
        active_deadline_seconds=int(job.timeout_s),
        clean_pod_policy="Running",
        termination_grace_s=job.termination_grace_s,
    )
