"""The checks of the plan step (:func:`llmft.components.lib.plan.build.build_plan`), and its Secret preflight.

Each check raises ConfigError naming the pipeline parameter and the fix, so a mistake costs
seconds on a CPU pod instead of a GPU job. :func:`preflight_secrets` reads the Secrets the plan
names through the Kubernetes API (on a cluster only) and names every missing Secret or key.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from typing import Any

from llmft.components.images import check_pinned
from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.contracts.choices import (
    CLUSTER_DEPLOY_MODES,
    CLUSTER_SWEEP_BACKENDS,
    DEPLOY_MODES,
    PIPELINE_OWNED_KEYS,
    SWEEP_BACKENDS,
)
from llmft.components.lib.contracts.run_jobs import KFP_POD_ENV
from llmft.components.lib.contracts.schema import DATA_MOUNT, Resources, SecretMount
from llmft.components.lib.contracts.volume_paths import check_path_component
from llmft.components.lib.jobs.backends import BACKENDS, backend_for, is_backend
from llmft.components.lib.jobs.katib_sweep import check_servable_ranks, check_trial_overrides
from llmft.components.lib.plan.parameters import COMPILE_TIME_PARAMETERS, PipelineParameters
from llmft.components.lib.plan.steps import RESOURCE_PARAMETERS
from llmft.components.lib.serving.servability import VLLM_MAX_LORA_RANKS
from llmft.katib.experiment import SweepSpec, apply_overrides
from llmft.katib.k8s_names import check_k8s_name
from llmft.trainer.config_load import BOOL_WORDS, split_assignment
from llmft.trainer.data.columns import mapped_format, parse_columns
from llmft.trainer.data.formats import FORMAT_CHOICES
from llmft.trainer.data.remote import is_remote, parse_remote, shown_url, url_credentials
from llmft.trainer.data.sources import CONFIG_ONLY_FOR_HUB
from llmft.trainer.errors import ConfigError, DataError
from llmft.trainer.mlflow_settings import redact_credentials

SECRET_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "hf": (("HF_TOKEN",), ("HF_TOKEN",)),
    "mlflow": (
        ("MLFLOW_TRACKING_URI",),
        ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"),
    ),
    "langfuse": (
        ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_HOST"),
        ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_HOST", "LANGFUSE_BASE_URL"),
    ),
    "s3": (
        ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
        (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
        ),
    ),
}
"""kind -> (keys mounted when the parameter names only the Secret, keys it may list). A key is
also the environment variable's name."""
SECRET_PARAMETERS = {
    "hf": "hf_token_secret",
    "mlflow": "mlflow_secret",
    "langfuse": "langfuse_secret",
    "s3": "s3_secret",
}
"""kind -> the pipeline parameter that names its Secret ('' = none)."""
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _fail(name: str, value: Any, message: str) -> ConfigError:
    return ConfigError(f"pipeline parameter `{name}`={value!r}: {message}")


def check_run_id(run_id: str) -> str:
    if not run_id or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", run_id):
        raise ConfigError(f"run id {run_id!r}: expected the KFP run id (letters, digits, '-', '_', '.')")
    return run_id


def check_general(p: PipelineParameters, on_cluster: bool) -> None:
    """The scalar parameters, and what cannot run on a cluster."""
    rules = [
        ("training_backend", is_backend(p.training_backend), f"use one of {', '.join(BACKENDS)}"),  # the registry
        ("serving_deploy_mode", p.serving_deploy_mode in DEPLOY_MODES, f"use one of {', '.join(DEPLOY_MODES)}"),
        ("dataset_format", p.dataset_format in FORMAT_CHOICES, f"use one of {', '.join(FORMAT_CHOICES)}"),  # prepare's
        ("training_workers", p.training_workers >= 1, "must be >= 1"),
        ("training_gpus_per_worker", p.training_gpus_per_worker >= 0, "must be >= 0"),
        ("serving_gpus", p.serving_gpus >= 0, "must be >= 0"),
        ("finetune_max_length", p.finetune_max_length >= 16, "must be >= 16 tokens"),
        ("dataset_val_fraction", 0.0 < p.dataset_val_fraction < 1.0, "must be in (0, 1)"),
        ("dataset_max_reject_fraction", 0.0 <= p.dataset_max_reject_fraction <= 1.0, "must be in [0, 1]"),
        ("promote_margin", 0.0 <= p.promote_margin < 1.0, "must be in [0, 1), e.g. 0.01 for 1%"),
        ("base_model", bool(p.base_model.strip()), "must name a hub id or a model directory"),
        ("dataset", bool(p.dataset.strip()), "must name a hub dataset or a file/folder on the volume"),
        ("training_timeout_s", p.training_timeout_s > 0, "must be > 0"),
        ("serving_deploy_timeout_s", p.serving_deploy_timeout_s > 0, "must be > 0"),
    ]
    for name, ok, message in rules:
        if not ok:
            raise _fail(name, getattr(p, name), message)
    check_dataset_source(p)
    check_path_component(p.mlflow_model_name, "mlflow_model_name")
    check_k8s_name(p.volume_pvc_name, "volume_pvc_name", kind="subdomain")
    if p.serving_namespace:
        check_k8s_name(p.serving_namespace, "serving_namespace")
    if p.serving_deploy and p.serving_deploy_mode == "kserve":
        check_k8s_name(p.serving_name, "serving_name", kind="dns1035", max_length=45)
    if on_cluster:
        _check_cluster_only(p)


def check_dataset_source(p: PipelineParameters) -> None:
    """A remote ``dataset`` is checked before any step fetches it: https (plain http is refused: the rows become
    the model's weights; an in-cluster store over http is s3:// with AWS_ENDPOINT_URL in the s3 Secret), a data
    file name, no credentials in the URL (the KFP UI shows parameters: a presigned URL is one); a configuration
    name only for a hub dataset."""
    dataset = p.dataset.strip()
    if is_remote(dataset):
        credentials = url_credentials(dataset)
        if credentials:
            raise _fail(
                "dataset",
                shown_url(dataset),
                f"the URL carries {credentials}, which the KFP UI and the run's logs would show. Put the file in "
                "S3 (or an S3-compatible store) and pass s3://bucket/key with s3_secret=<Secret with AWS_* keys>",
            )
        parse_remote(dataset, where="pipeline parameter `dataset`")
    if p.dataset_config and (is_remote(dataset) or dataset.startswith(("/", "langfuse://", "sample:"))):
        raise _fail("dataset_config", p.dataset_config, CONFIG_ONLY_FOR_HUB + "; leave it empty for this dataset")


def check_dataset_columns(p: PipelineParameters) -> str:
    """``dataset_columns`` parses and names one format (the one ``dataset_format`` says, if any); returned as
    given for the prepare step."""
    where = "pipeline parameter `dataset_columns`"
    try:
        mapped_format(parse_columns(p.dataset_columns, where=where), p.dataset_format, where=where)
    except DataError as exc:  # the same rule as --columns, told as the parameter's error
        raise ConfigError(str(exc)) from None
    return p.dataset_columns


def _check_cluster_only(p: PipelineParameters) -> None:
    """A training backend that runs in the step (the registry's ``needs_cluster`` false) and a deploy mode that
    runs on this machine need torch, transformers or vLLM, which the pipeline image lacks; and every task mounts
    the volume at DATA_MOUNT."""
    backend = backend_for(p.training_backend)
    if not backend.needs_cluster:
        use = next(b.name for b in BACKENDS.values() if b.needs_cluster)
        raise _runs_here_only("training_backend", backend.name, use)
    if p.serving_deploy and p.serving_deploy_mode not in CLUSTER_DEPLOY_MODES:
        raise _runs_here_only("serving_deploy_mode", p.serving_deploy_mode, CLUSTER_DEPLOY_MODES[0])
    if p.volume_path != DATA_MOUNT:
        raise _fail(
            "volume_path", p.volume_path, f"on a cluster every task mounts the PVC at {DATA_MOUNT}; keep the default"
        )


def _runs_here_only(name: str, value: str, use: str) -> ConfigError:
    return _fail(
        name,
        value,
        f"`{value}` runs only under kfp.local (llmft pipeline run-local); this task runs on a cluster "
        f"({KFP_POD_ENV} is set), whose pipeline image has no torch or vLLM: use {name}={use}",
    )


def check_runs_here(plan) -> None:
    """kfp.local: a backend that creates cluster objects cannot run here. Refused in one line by the plan step,
    before prepare and tokenize, instead of the train (or sweep) step failing after them."""
    backend = backend_for(plan.job.backend)
    if backend.needs_cluster:
        local = next(b.name for b in BACKENDS.values() if not b.needs_cluster)
        raise _fail(
            "training_backend",
            backend.name,
            f"`{backend.name}` creates a {backend.resource.kind if backend.resource else 'cluster job'}, which runs "
            f"only on a cluster; this run is under kfp.local ({KFP_POD_ENV} is not set): use "
            f"training_backend={local}, or submit the pipeline to a cluster (llmft pipeline submit)",
        )
    if plan.sweep is not None and plan.sweep.backend in CLUSTER_SWEEP_BACKENDS:
        raise _fail(
            "hpo_backend",
            plan.sweep.backend,
            f"`{plan.sweep.backend}` creates a Katib Experiment, which runs only on a cluster; this run is under "
            f"kfp.local ({KFP_POD_ENV} is not set): use hpo_backend="
            f"{next(b for b in SWEEP_BACKENDS if b not in CLUSTER_SWEEP_BACKENDS)}",
        )


def check_image(reference: str) -> str:
    return check_pinned(reference, source="pipeline parameter `training_image`")


def check_runtime(name: str) -> str:
    return check_k8s_name(name, "serving_runtime", kind="subdomain")


def parse_secret(kind: str, text: str):
    """``NAME`` or ``NAME:KEY,KEY`` -> SecretMount ('' -> None)."""
    text = (text or "").strip()
    if not text:
        return None
    param = SECRET_PARAMETERS[kind]
    default_keys, allowed = SECRET_KINDS[kind]
    name, _, key_text = text.partition(":")
    check_k8s_name(name, param, kind="subdomain")
    keys = tuple(k.strip() for k in key_text.split(",") if k.strip()) if key_text else default_keys
    unknown = [k for k in keys if k not in allowed]
    if unknown or not keys:
        raise _fail(
            param, text, f"keys {unknown or '(none)'}: use NAME or NAME:KEY,KEY with keys from {', '.join(allowed)}"
        )
    return SecretMount(kind=kind, name=name, keys=tuple(dict.fromkeys(keys)))


def extra_override_list(text: str, what: str = "finetune_overrides") -> list[str]:
    """Split free-form ``key=value`` overrides, refusing keys the plan sets itself."""
    items = shlex.split(text or "")
    for item in items:
        try:
            key = split_assignment(item, "save_every=50")[0]
        except ConfigError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        if key in PIPELINE_OWNED_KEYS:
            raise ConfigError(f"{what}: `{key}` is set by the pipeline; use the pipeline parameter instead")
    return items


def check_resources(names: tuple[str, str], cpu: str, memory: str):
    """``cpu`` and ``memory`` (the parameters ``names``) as Kubernetes quantities above zero."""
    from kubernetes.utils import parse_quantity  # heavy: kubernetes

    for name, value, example in ((names[0], cpu, "'4' or '500m'"), (names[1], memory, "'16Gi'")):
        try:
            ok = parse_quantity(str(value)) > 0
        except ValueError:
            ok = False
        if not ok:
            raise _fail(name, value, f"not a positive Kubernetes quantity (e.g. {example})")
    return Resources(cpu=str(cpu), memory=str(memory))


def task_resources(p: PipelineParameters) -> dict:
    return {
        group: check_resources((cpu, mem), getattr(p, cpu), getattr(p, mem))
        for group, (cpu, mem) in RESOURCE_PARAMETERS.items()
    }


def parse_node_selector(text: str) -> dict[str, str]:
    """``key=value[,key=value]`` -> labels ('' = no node selector)."""
    labels: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = (part.strip() for part in item.partition("="))
        prefix, _, name = key.rpartition("/")
        valid_key = bool(name) and _LABEL_NAME.match(name) and (not prefix or _LABEL_PREFIX.match(prefix))
        if not sep or not valid_key or len(value) > 63 or not _LABEL_NAME.match(value):
            raise _fail(
                "gpu_node_selector",
                text,
                "expected label=value pairs separated by commas (e.g. nvidia.com/gpu.present=true); '' = none",
            )
        labels[key] = value
    return labels


def check_tracking(p: PipelineParameters, on_cluster: bool, environ: Mapping[str, str]) -> bool:
    """Whether the run has an MLflow server: the parameter, the mlflow Secret's URI key, or (off a cluster)
    MLFLOW_TRACKING_URI in the environment. None of them: MLflow is optional, the run trains, evaluates, promotes
    and deploys without it and records "not registered" (False). A parameter never carries credentials: the KFP
    UI shows it and the train step copies it into the training job's environment."""
    if p.mlflow_tracking_uri:
        if redact_credentials(p.mlflow_tracking_uri) != p.mlflow_tracking_uri:
            raise _fail(
                "mlflow_tracking_uri",
                redact_credentials(p.mlflow_tracking_uri),
                "holds a user name or password, which the KFP UI would show; put them in the mlflow Secret "
                "(keys MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, deploy/secrets) and pass the URL alone",
            )
        check_cluster_store(p.mlflow_tracking_uri, on_cluster)
        return True
    secret = parse_secret("mlflow", p.mlflow_secret)
    if secret is not None and "MLFLOW_TRACKING_URI" in secret.keys:
        return True
    return not on_cluster and bool(environ.get("MLFLOW_TRACKING_URI"))


DATABASE_STORES = ("sqlite", "postgresql", "mysql", "mssql")
"""URI schemes of MLflow's database stores: the full mlflow package opens them, mlflow-skinny (the trainer image's
client, setup.cfg's observe extra) does not (mlflow 3.x tracking/_tracking_service/utils.py's store registry)."""


def check_cluster_store(uri: str, on_cluster: bool) -> None:
    """On a cluster the training job and the evaluate step talk to MLflow from the trainer image, whose client
    cannot open a database store: refuse it at plan time, in one line, rather than fail the evaluate step."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower()
    if on_cluster and scheme in DATABASE_STORES:
        raise _fail(
            "mlflow_tracking_uri",
            redact_credentials(uri),
            "is a database store, which the trainer image's MLflow client (mlflow-skinny) cannot open; run an "
            "MLflow server on it (mlflow server --backend-store-uri ...) and give the server's http(s) URL",
        )


def check_serving(plan, config) -> str:
    """What vLLM can serve as a LoRA module: a plain LoRA adapter of rank <= serving_max_lora_rank (a vLLM-accepted
    value). ``serving_mode=lora`` refuses anything else; ``auto`` serves it merged into its base instead.
    Returns why the adapter will be served merged ('' = as a LoRA module, or decided after promotion)."""
    if config.method == "full" or not plan.serving.deploy:
        return ""

    rank, mode = plan.serving.max_lora_rank, plan.serving.serving_mode
    if rank not in VLLM_MAX_LORA_RANKS:
        raise _fail("serving_max_lora_rank", rank, f"vLLM accepts only {', '.join(map(str, VLLM_MAX_LORA_RANKS))}")
    if mode == "merged":
        return "serving_mode=merged"
    refusals = []
    if config.lora.use_dora:
        refusals.append("lora.use_dora=true (DoRA): vLLM does not serve DoRA adapters")
    if config.lora.r > rank:
        refusals.append(f"`finetune_lora_r`={config.lora.r} exceeds `serving_max_lora_rank`={rank} of the vLLM runtime")
    if refusals and mode == "lora":
        raise ConfigError(
            f"pipeline parameters: {'; '.join(refusals)}, so vLLM would refuse the adapter and serving_mode=lora "
            "serves adapters only as LoRA modules. Train a plain LoRA adapter of rank <= serving_max_lora_rank (lower "
            "finetune_lora_r or raise serving_max_lora_rank; lora.use_dora=false), or set serving_mode=auto to serve "
            "it merged"
        )
    return f"{'; '.join(refusals)}: the adapter will be served merged into its base model" if refusals else ""


def check_sweep(plan, max_lora_rank: int) -> None:
    """The sweep spec parses, its ranks are servable, and its fixed trial settings clash with nothing."""
    sweep = plan.sweep
    if sweep.backend not in SWEEP_BACKENDS:
        raise _fail("hpo_backend", sweep.backend, f"use one of {', '.join(SWEEP_BACKENDS)}")
    if sweep.backend not in CLUSTER_SWEEP_BACKENDS and plan.on_cluster:
        raise _fail(
            "hpo_backend",
            sweep.backend,
            f"`{sweep.backend}` runs only under kfp.local ({KFP_POD_ENV} is set: this is a cluster); use "
            f"hpo_backend={CLUSTER_SWEEP_BACKENDS[0]}",
        )
    if sweep.backend in CLUSTER_SWEEP_BACKENDS:
        backend_for(plan.job.backend).trials_backend()  # its explicit Katib trial policy: none is refused here
    spec = apply_overrides(SweepSpec(name=sweep.experiment), list(sweep.settings))
    if plan.serving.deploy and plan.trainer.method != "full" and plan.serving.serving_mode != "merged":
        check_servable_ranks(spec, max_lora_rank)  # auto too: the sweep's winner must not decide the serving form
    check_trial_overrides(spec, sweep.trial_overrides)


def preflight_secrets(plan, cluster=None) -> list[str]:
    """On a cluster: read every Secret the run mounts (tasks, job, InferenceService); raise ConfigError
    naming each missing Secret or key. Returns notes for what could not be checked (no RBAC to read Secrets)."""

    cluster = cluster or cluster_module.Cluster()
    wanted: dict[tuple[str, str], set[str]] = {}
    for secret in (*plan.task_secrets, *plan.job.secrets):
        wanted.setdefault((secret.name, cluster.namespace), set()).update(secret.keys)
    if plan.serving.deploy and plan.serving.mode == "kserve" and plan.serving.hf_secret is not None:
        namespace = plan.serving.namespace or cluster.namespace
        wanted.setdefault((plan.serving.hf_secret.name, namespace), set()).update(plan.serving.hf_secret.keys)
    missing, notes = [], []
    for (name, namespace), keys in sorted(wanted.items()):
        try:
            secret = cluster.core_api.read_namespaced_secret(name, namespace)
        except Exception as exc:  # noqa: BLE001 - kubernetes ApiException or a transport error
            status = getattr(exc, "status", None)
            if status == 404:
                missing.append(f"Secret {namespace}/{name} does not exist (keys {', '.join(sorted(keys))})")
            else:
                notes.append(f"could not read Secret {namespace}/{name} ({_reason(exc)}): not checked")
            continue
        present = set(getattr(secret, "data", None) or {}) | set(getattr(secret, "string_data", None) or {})
        absent = sorted(keys - present)
        if absent:
            missing.append(f"Secret {namespace}/{name} lacks key(s) {', '.join(absent)}")
    if missing:
        raise ConfigError(
            "the Secrets this run mounts are incomplete (a pod would hang in CreateContainerConfigError):\n- "
            + "\n- ".join(missing)
            + "\nCreate them (deploy/secrets/README.md), or name other Secrets/keys with hf_token_secret, "
            "mlflow_secret, langfuse_secret, s3_secret (NAME or NAME:KEY,KEY)"
        )
    return notes


SERVING_VERBS = ("create", "get", "update")
"""What the deploy step does to its InferenceService (serving/inferenceservice.py: create, or get and replace;
then polls)."""


def preflight_serving_namespace(plan, cluster=None) -> None:
    """A ``serving_namespace`` other than the pipeline's works only with the data PVC there (``pvc://``
    mounts a claim by name in the predictor pod, kserve v0.20.0 pkg/utils/storage.go 107-115, and a pod's
    claim is always of its own namespace) and
    a RoleBinding there letting this service account manage InferenceServices (deploy/role.yaml binds
    the pipeline's namespace only). ConfigError, one line, naming what is missing."""

    serving = plan.serving
    if not (serving.deploy and serving.mode == "kserve" and serving.namespace):
        return
    cluster = cluster or cluster_module.Cluster()
    there = serving.namespace
    if there == cluster.namespace:
        return
    missing = []
    try:
        claim = cluster.core_api.read_namespaced_persistent_volume_claim(serving.pvc_name, there)
    except Exception as exc:  # noqa: BLE001 - kubernetes ApiException or a transport error
        found = "does not exist" if getattr(exc, "status", None) == 404 else f"cannot be read ({_reason(exc)})"
        missing.append(f"PVC {there}/{serving.pvc_name} {found}")
    else:
        missing += claim_problems(claim, f"{there}/{serving.pvc_name}")
    denied = [verb for verb in SERVING_VERBS if not _may(cluster, verb, there)]
    if denied:
        missing.append(f"no RoleBinding in {there} lets this service account {'/'.join(denied)} inferenceservices")
    if missing:
        raise ConfigError(
            f"serving_namespace={there}: " + "; ".join(missing) + f". Create the PVC {serving.pvc_name} in {there} on "
            "the same volume (a PersistentVolume of the data PVC's storage, claimed there) and bind this service "
            "account there to a Role granting create/get/update on inferenceservices and get on "
            "persistentvolumeclaims (docs/cluster-guide.md, Serving in another namespace), or leave "
            "serving_namespace empty to serve in the pipeline's namespace"
        )


PROVISIONER_ANNOTATIONS = ("volume.kubernetes.io/storage-provisioner", "volume.beta.kubernetes.io/storage-provisioner")
"""Set on a claim the PersistentVolume controller provisions a volume for (kubernetes
pkg/controller/volume/persistentvolume/pv_controller.go ``setClaimProvisioner``); a claim bound to a volume
that existed (a static PersistentVolume of the same export) has neither."""
SHARED_ACCESS_MODES = ("ReadWriteMany", "ReadOnlyMany")


def claim_problems(claim, where: str) -> list[str]:
    """What shows a serving namespace's claim cannot be the pipeline's data volume: not Bound; provisioned by a
    StorageClass (a new, empty volume: its own directory or disk, not the one the pipeline wrote); or mountable
    from one node only (the predictor reads it beside the pipeline's pods)."""
    status, spec = claim.status, claim.spec
    phase = (status.phase if status else None) or "Pending"
    if phase != "Bound":
        return [f"PVC {where} is {phase}, not Bound"]
    annotations = (claim.metadata.annotations if claim.metadata else None) or {}
    provisioner = next((annotations[a] for a in PROVISIONER_ANNOTATIONS if a in annotations), None)
    problems = []
    if provisioner:
        storage_class = (spec.storage_class_name if spec else None) or "the default"
        problems.append(
            f"PVC {where} was provisioned by {provisioner} (storage class {storage_class}): a new, empty volume, not "
            "the pipeline's (bind it to a PersistentVolume of the same storage instead)"
        )
    modes = (spec.access_modes if spec else None) or []
    if not any(mode in SHARED_ACCESS_MODES for mode in modes):
        problems.append(
            f"PVC {where} is {'/'.join(modes) or 'without access modes'}: it needs ReadWriteMany or ReadOnlyMany"
        )
    return problems


def _may(cluster, verb: str, namespace: str) -> bool:
    try:
        return cluster.may(verb, "serving.kserve.io", "inferenceservices", namespace)
    except Exception:  # noqa: BLE001 - a review that did not answer proves nothing: counted as denied
        return False


def _reason(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    if status == 403:
        return "HTTP 403: the pipeline's service account may not read Secrets; deploy/role.yaml grants none on purpose"
    return f"HTTP {status}" if status else type(exc).__name__


def compiled_settings(pipeline: str, values: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str:
    """The ``compiled`` JSON the pipeline passes to the plan step: its name, whether it sweeps (the HPO forms:
    ``llm-finetune-hpo[-minimal]``), the compile-time values its own tasks apply (for the record), and
    ``allow_remote_code``, read from :data:`REMOTE_CODE_ENV` where the pipeline is compiled (a run's
    parameters cannot change it)."""
    environ = os.environ if environ is None else environ
    return json.dumps(
        {
            "pipeline": pipeline,
            "hpo": "hpo" in pipeline.split("-"),
            "compiled": {name: values[name] for name in COMPILE_TIME_PARAMETERS},
            "allow_remote_code": environ.get(REMOTE_CODE_ENV, "") in ("1", "true", "yes"),
        }
    )


REMOTE_CODE_ENV = "LLMFT_ALLOW_REMOTE_CODE"
"""Set to 1 where the pipeline is compiled to let its runs set ``model.trust_remote_code=true``."""
REMOTE_CODE_KEY = "model.trust_remote_code"
TRUE_WORDS = tuple(word for word, value in BOOL_WORDS.items() if value)


def check_remote_code(config, settings: Mapping[str, Any], trial_overrides: tuple[str, ...] = ()) -> bool:
    """``model.trust_remote_code=true`` (in finetune_overrides, or a sweep's trial overrides) runs Python code
    from the model's repository in pods that hold the run's credentials: refused unless the pipeline was
    compiled with :data:`REMOTE_CODE_ENV`=1, and then announced in a WARNING line. Returns whether it is on."""
    wanted = bool(config.model.trust_remote_code) or any(
        split_assignment(item)[0] == REMOTE_CODE_KEY and split_assignment(item)[1].strip().lower() in TRUE_WORDS
        for item in trial_overrides
    )
    if not wanted:
        return False
    if not settings.get("allow_remote_code"):
        raise ConfigError(
            f"finetune_overrides: {REMOTE_CODE_KEY}=true runs code from the model's repository inside the training "
            "pods, which hold the run's credentials; this pipeline was compiled without allowing it. Drop it, or "
            f"recompile with {REMOTE_CODE_ENV}=1 llmft pipeline compile ... if you trust that repository"
        )
    print(
        f"WARNING: {REMOTE_CODE_KEY}=true: the training pods will RUN PYTHON CODE FROM THE MODEL REPOSITORY "
        f"{config.model.name_or_path} (allowed: the pipeline was compiled with {REMOTE_CODE_ENV}=1)",
        flush=True,
    )
    return True
