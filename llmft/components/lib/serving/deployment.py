"""What the deploy step does, in order: servability check, InferenceService, validation, deploy.

:func:`deploy_promoted` serves the form the serving-form step chose (serving.json,
:mod:`llmft.components.lib.serving.serving_form`): for ``lora`` it checks the promoted adapter is servable by
vLLM (:mod:`llmft.components.lib.serving.servability`); for ``merged`` it serves the merged model directory
alone. It builds the InferenceService
(:mod:`llmft.components.lib.serving.inferenceservice`), writes it as YAML and validates it against the
InferenceService CRD's OpenAPI schema, then

* mode ``kserve``: applies it through the cluster module, waits for Ready and smoke-tests
  the OpenAI endpoints: the base model's name listed (KServe lists no adapter name), and the
  adapter's completion, answered under its name, is not the base model's (merged form: its one
  name listed and answering);
* mode ``local``: loads base + adapter (or the merged model) with transformers and generates for a
  few prompts, failing if the adapter changes nothing;
* mode ``vllm`` (kfp.local, ``llmft serve check``): starts a real vLLM OpenAI server on this machine with the
  manifest's own arguments (:mod:`llmft.components.lib.serving.vllm_local`), runs the same smoke test as ``kserve``
  for each prompt, and stops it; deployment.json carries ``models`` and ``answers``.

With ``serving_deploy=false`` it stops after the validated manifest, and so it does for a version that
did not become the registry's champion (``serving_deploy_policy=champion``, the default): the served model
stays the champion; ``serving_deploy_policy=always`` deploys it anyway.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from llmft.components.lib.cluster import Cluster
from llmft.components.lib.contracts.choices import DEPLOY_MODES
from llmft.components.lib.contracts.pod_parts import SecretEnv
from llmft.components.lib.contracts.schema import DataLayout
from llmft.components.lib.registry.mlflow_registry import is_champion
from llmft.components.lib.serving.inferenceservice import (
    CHAT_ROUTE,
    ServeSpec,
    build_inference_service,
    isvc_to_dict,
    served_models,
    smoke_test,
)
from llmft.components.lib.serving.isvc_apply import deploy_inference_service
from llmft.components.lib.serving.local_check import local_generation_check
from llmft.components.lib.serving.servability import AdapterNotServableError, check_vllm_servable
from llmft.components.lib.serving.vllm_local import serve_and_check
from llmft.trainer.errors import ConfigError, LlmftError
from llmft.trainer.io import atomic_write_text, is_complete

CRD_FILE = "serving.kserve.io_inferenceservices.yaml"
CRD_DIR_ENV = "LLMFT_CRD_DIR"
DEFAULT_PROMPTS = ("What is the capital of France?", "Name three primary colors.")


@dataclass(frozen=True)
class DeployRequest:
    """The deploy step's inputs."""

    adapter_dir: str
    """Promoted adapter folder on the data volume."""
    base_model: str
    """Base model: hub id, or a directory (on the data volume, for KServe to mount it)."""
    adapter_name: str
    """Name clients request for the adapter (the registered model name)."""
    version: str
    """Registered model version (a label on the InferenceService)."""
    deploy: bool
    """False: stop after writing and validating the manifest."""
    mode: str
    """kserve, local or vllm (DEPLOY_MODES)."""
    name: str
    """InferenceService name."""
    namespace: str
    """Namespace ('' = the pipeline's own)."""
    gpus: int
    """GPUs of the predictor."""
    max_lora_rank: int
    """vLLM --max-lora-rank."""
    pvc_name: str
    """PVC holding the adapter (mounted read-only at /mnt/models)."""
    data_root: str
    """Where that PVC is mounted in this step."""
    timeout_s: int = 1800
    """How long to wait for Ready."""
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    """Prompts of the local generation check and the smoke test."""
    cpu: str = "4"
    """CPU request and limit of the predictor."""
    memory: str = "32Gi"
    """Memory request and limit of the predictor."""
    runtime: str = ""
    """(Cluster)ServingRuntime ('' = llmft/components/images.py's default in this process; the plan always names it)."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """Node labels the predictor must match."""
    hf_secret: Any = None
    """The plan's SecretMount of the HF token (its HF_TOKEN key, required), or None."""
    is_champion: bool = True
    """Whether the register step made this version the champion (registration.json ``is_champion``)."""
    registered: bool = True
    """False: the run has no MLflow (registration.json ``registered: false``): no champion to compare with, the
    promoted adapter (which beat the base model) is served, and the result says so."""
    deploy_policy: str = "champion"
    """champion: deploy only the champion; always: deploy this version even when it lost."""
    form: str = "lora"
    """The serving form (serving.json): lora (base + adapter as a LoRA module), merged (``model_dir`` alone) or
    full (a full fine-tune: not served by this step)."""
    model_dir: str = ""
    """Merged form: the merged model directory on the data volume."""
    form_reason: str = ""
    """Why that form (logged)."""
    rollout: str = "Recreate"
    """How a redeploy in raw (Standard/RawDeployment) mode replaces the predictor's pods
    (``predictor.deploymentStrategy.type``): Recreate (the default: the old pod goes first, so a redeploy
    needs no spare GPU; the model is unavailable while the new pod loads) or RollingUpdate (KServe's default:
    25% surge, the new pod needs a free GPU before the old one goes). See :data:`ROLLOUTS`; Knative mode
    takes no strategy (llmft/components/lib/serving/deployment_mode.py)."""
    vllm_options: Mapping[str, Any] = field(default_factory=dict)
    """mode vllm: ``max_tokens`` of the answers and keyword arguments of
    :class:`llmft.components.lib.serving.vllm_local.VllmServer` (port, log_path, extra_argv, ...)."""


ROLLOUTS = ("Recreate", "RollingUpdate")
"""Values of DeployRequest.rollout (Kubernetes apps/v1 DeploymentStrategyType).

KServe honours ``predictor.deploymentStrategy`` in raw mode only (v0.20.0
pkg/apis/serving/v1beta1/component.go 129-131: "Only applicable for raw deployment mode"); its
deployment reconciler copies it onto the Deployment, and without it sets RollingUpdate with maxSurge and
maxUnavailable 25% (pkg/controller/v1beta1/inferenceservice/reconcilers/deployment/deployment_reconciler.go
162-168, 340-350). One GPU predictor: 25% rounds up to one surge pod, which stays Pending without a spare GPU,
so a redeploy never becomes Ready. In Knative (Serverless) mode KServe's webhook refuses the field, so the
deploy step sets it only on a redeploy of an InferenceService the cluster runs in raw mode
(llmft/components/lib/serving/deployment_mode.py); there a new Revision is started beside the old one and
traffic moves once it is Ready, so a redeploy needs a spare GPU (docs/cluster-guide.md, Redeploying)."""


UNREGISTERED = "unregistered"
"""The version label of an adapter a run without MLflow serves."""
NO_REGISTRY_NOTE = (
    "no MLflow registry: the promoted adapter (it beat the base model at the gate) is served; with no champion "
    "to compare with, deploy_policy=champion does not apply"
)


def plan_deploy_request(
    run_plan, *, adapter_dir: str, registered: Mapping[str, Any], form: str, model_dir: str = "", form_reason: str = ""
) -> DeployRequest:
    """The one DeployRequest of a run: the plan's serving settings (``run_plan``, a RunPlan) for the promoted
    adapter ``adapter_dir`` the register step recorded as ``registered`` (registration.json), served in
    ``form`` (serving.json). The deploy step sends it as is; ``make demo-real`` changes the form it serves."""
    settings = run_plan.serving
    in_registry = registered.get("registered", True) is not False
    return DeployRequest(
        adapter_dir=adapter_dir,
        base_model=run_plan.trainer.model,
        adapter_name=registered["model_name"],
        version=str(registered["version"]) if in_registry else UNREGISTERED,
        deploy=settings.deploy,
        mode=settings.mode,
        name=settings.name,
        namespace=settings.namespace,
        gpus=settings.gpus,
        max_lora_rank=settings.max_lora_rank,
        pvc_name=settings.pvc_name,
        data_root=run_plan.layout.root,
        timeout_s=settings.timeout_s,
        cpu=settings.resources.cpu,
        memory=settings.resources.memory,
        runtime=settings.runtime,
        node_selector=settings.node_selector,
        hf_secret=settings.hf_secret,
        is_champion=is_champion(registered) if in_registry else True,
        registered=in_registry,
        deploy_policy=settings.deploy_policy,
        form=form,
        model_dir=model_dir,
        form_reason=form_reason,
        prompts=tuple(settings.prompts) or DEFAULT_PROMPTS,
    )


def deployment_metadata(result: dict[str, Any], *, mode: str, form: str, model: str) -> dict[str, Any]:
    """The deploy step's output metadata: mode, form, status, the name to request and, when something serves it on
    a cluster, its ``url`` and ``endpoint`` (the OpenAI chat route); no placeholder where nothing serves."""
    metadata: dict[str, Any] = {"mode": mode, "form": form, "status": result["status"], "model": model}
    if result.get("url"):
        metadata |= {"url": result["url"], "endpoint": result["url"] + CHAT_ROUTE}
    return metadata


def serve_spec(req: DeployRequest):
    """The :class:`ServeSpec` of the request (adapter and, if there, base model from the PVC)."""

    layout = DataLayout(req.data_root)
    extra: dict[str, Any] = {"runtime": req.runtime} if req.runtime else {}
    common = dict(
        name=req.name,
        pvc_name=req.pvc_name,
        adapter_path=layout.relative(req.adapter_dir),
        lora_name=req.adapter_name,
        namespace=req.namespace or None,
        max_lora_rank=req.max_lora_rank,
        gpus=req.gpus,
        cpu=req.cpu,
        memory=req.memory,
        node_selector=dict(req.node_selector),
        labels={"llmft/model-version": str(req.version)},
        **extra,
    )
    if req.form == "merged":  # one plain model on the volume: no base model, no HF token
        return ServeSpec(**common, merged_model_path=layout.relative(req.model_dir), hf_token_secret=None)
    on_volume = req.base_model.startswith(layout.root.rstrip("/") + "/")
    if not on_volume and os.path.isdir(req.base_model) and req.mode == "kserve":
        raise ConfigError(
            f"base model {req.base_model} is a local directory outside the data volume "
            f"({layout.root}): KServe cannot mount it. Put it on the PVC or use a hub id."
        )
    base: dict[str, Any] = (
        {"base_model_path": layout.relative(req.base_model)} if on_volume else {"base_model_id": req.base_model}
    )
    secret = req.hf_secret
    hf = (
        SecretEnv("HF_TOKEN", secret.name, "HF_TOKEN", optional=False) if secret and "HF_TOKEN" in secret.keys else None
    )
    return ServeSpec(**common, hf_token_secret=hf, **base)


def find_crd(crd_dir: str | None = None) -> Path | None:
    """The InferenceService CRD file in ``crd_dir``, else in ``$LLMFT_CRD_DIR``; None when neither has it."""
    for folder in filter(None, (crd_dir, os.environ.get(CRD_DIR_ENV))):
        path = Path(folder) / CRD_FILE
        if path.is_file():
            return path
    return None


def crd_schema_errors(obj: dict[str, Any], crd_path: str | Path) -> list[str]:
    """Every place ``obj`` violates the CRD's openAPIV3Schema for its apiVersion (jsonschema)."""
    with open(crd_path) as fh:
        crd = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = obj["apiVersion"].split("/")[-1]
    schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]


def write_manifest(isvc_dict: dict[str, Any], path: str | Path, *, crd_dir: str | None = None) -> dict[str, Any]:
    """Write the manifest (atomically) and validate it; raises ConfigError on schema errors."""

    atomic_write_text(path, yaml.safe_dump(isvc_dict, sort_keys=False))
    crd = find_crd(crd_dir)
    if crd is None:
        return {
            "manifest": str(path),
            "schema_validated": False,
            "schema_note": f"CRD {CRD_FILE} not found (set {CRD_DIR_ENV}); checked by the SDK model and rules only",
        }
    errors = crd_schema_errors(isvc_dict, crd)
    if errors:
        raise ConfigError(
            f"{path}: the InferenceService does not match the CRD schema {crd}:\n- " + "\n- ".join(errors)
        )
    return {"manifest": str(path), "schema_validated": True, "crd": str(crd)}


def deploy_promoted(
    req: DeployRequest,
    *,
    manifest_path: str | Path,
    cluster=None,
    crd_dir: str | None = None,
    http_post=None,
    http_get=None,
) -> dict[str, Any]:
    """Run the whole deploy step; return the facts for deployment.json."""

    if req.mode not in DEPLOY_MODES:
        raise ConfigError(f"deploy_mode {req.mode!r}: use one of {', '.join(DEPLOY_MODES)}")
    if req.form == "merged":
        _check_merged(req)
    else:
        _check_lora(req)
    spec = serve_spec(req)
    body = inference_service_body(req, spec)
    names = served_models(spec)
    result: dict[str, Any] = {
        "mode": req.mode,
        "form": req.form,
        "servable": True,
        "name": req.name,
        "lora_name": req.adapter_name,
        "base_name": names[0] if len(names) == 2 else None,
        "served_models": list(names),
        **write_manifest(body, manifest_path, crd_dir=crd_dir),
    }
    print(f"manifest: {manifest_path} (CRD schema {'ok' if result['schema_validated'] else 'not checked'})")
    if not req.registered:
        print(NO_REGISTRY_NOTE)
        result["note"] = NO_REGISTRY_NOTE
    if not req.deploy:
        return {**result, "status": "manifest-only"}
    if req.deploy_policy == "champion" and not req.is_champion:
        print(
            f"not deploying version {req.version}: it did not beat the champion in the registry, which stays "
            "served (set serving_deploy_policy=always to deploy it anyway)"
        )
        return {**result, "status": "not-champion"}
    if req.mode == "local":
        return {**result, **_local_check(req)}
    if req.mode == "vllm":
        return {**result, **_vllm_check(req, body, names)}
    return {**result, **_deploy_to_kserve(req, body, cluster, http_post, http_get)}


def inference_service_body(req: DeployRequest, spec: ServeSpec | None = None) -> dict[str, Any]:
    """The InferenceService of the request as a dict, as a first deploy sends it: no deployment mode and no
    deploymentStrategy, which every KServe release admits in either mode; a redeploy adds the rollout
    (:data:`ROLLOUTS`) where the cluster runs it in raw mode (llmft/components/lib/serving/isvc_apply.py)."""

    if req.rollout not in ROLLOUTS:
        raise ConfigError(f"rollout {req.rollout!r}: use one of {', '.join(ROLLOUTS)}")
    return isvc_to_dict(build_inference_service(spec or serve_spec(req)))


def _check_lora(req: DeployRequest) -> None:
    """The adapter vLLM loads as a LoRA module: refused here, not when the server starts."""

    if not (Path(req.adapter_dir) / "adapter_config.json").is_file():
        raise LlmftError(
            f"{req.adapter_dir} holds full model weights, not a LoRA adapter: this step serves adapters "
            "with vLLM's LoRA support. Set serving_deploy=false for finetune_method=full, or train with "
            "finetune_method=lora."
        )
    problems = check_vllm_servable(req.adapter_dir, max_lora_rank=req.max_lora_rank)
    if problems:
        raise AdapterNotServableError(
            f"adapter {req.adapter_dir} cannot be served by vLLM:\n- " + "\n- ".join(problems)
        )
    print(f"servability: {req.adapter_dir} can be served by vLLM (max LoRA rank {req.max_lora_rank})")


def _check_merged(req: DeployRequest) -> None:
    """The merged model the serving-form step wrote: complete, a plain model (no quantization_config)."""

    config = Path(req.model_dir) / "config.json"
    if not req.model_dir or not is_complete(req.model_dir) or not config.is_file():
        raise LlmftError(
            f"merged model {req.model_dir or '(none)'}: missing or incomplete (no COMPLETE marker or config.json); "
            "the serving-form step writes it: re-run the pipeline"
        )
    if "quantization_config" in json.loads(config.read_text()):
        raise LlmftError(f"{config}: has a quantization_config; a merged model is dense (llmft export --merge)")
    print(f"serving form: merged ({req.form_reason or 'serving.json'}): {req.model_dir} served as {req.adapter_name!r}")


def _local_check(req: DeployRequest) -> dict[str, Any]:

    merged = req.model_dir if req.form == "merged" else None
    samples = local_generation_check(req.base_model, req.adapter_dir, list(req.prompts), merged_path=merged)
    for s in samples:
        print(f"prompt: {s.prompt!r}\n  base:    {s.base_text!r}\n  adapter: {s.adapter_text!r}")
    return {
        "status": "checked-locally",
        "samples": [{"prompt": s.prompt, "base": s.base_text, "adapter": s.adapter_text} for s in samples],
    }


def _vllm_check(req: DeployRequest, body: dict, names: tuple[str, ...]) -> dict[str, Any]:

    served = serve_and_check(
        body, names, list(req.prompts), pvc_name=req.pvc_name, data_root=req.data_root, **dict(req.vllm_options)
    )
    for sample in served["samples"]:
        print(f"prompt: {sample['prompt']!r}")
        for name, text in sample["answers"].items():
            print(f"  {name}: {text!r}")
    return {"status": "served-vllm", **served}


def _deploy_to_kserve(req: DeployRequest, body: dict, cluster, http_post, http_get) -> dict[str, Any]:

    cluster = cluster or Cluster(req.namespace or None)
    served = deploy_inference_service(cluster, body, timeout_s=req.timeout_s, rollout=req.rollout)
    url = served.get("internal_url") or served["url"]
    names = served_models(serve_spec(req))  # (base, adapter), or (merged,)
    adapter_name, base_name = names[-1], (names[0] if len(names) == 2 else None)
    smoke = smoke_test(url, adapter_name, req.prompts[0], base_name=base_name, http_post=http_post, http_get=http_get)
    base_text = f", {base_name!r} answered {smoke['base_text']!r}" if base_name else " (merged form: one model)"
    print(f"smoke test: {smoke['endpoint']}: {adapter_name!r} answered {smoke['text']!r}{base_text}")
    return {
        "status": "deployed",
        "url": served["url"],
        "internal_url": served.get("internal_url"),
        "deployment_mode": served.get("deployment_mode"),
        "smoke_test": smoke,
    }
