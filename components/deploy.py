"""Step 7: deploy the promoted adapter to KServe on the vLLM backend (or check it locally)."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Model, Output
from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def deploy_adapter(
    promoted: Input[Model],
    registration: Input[Artifact],
    model: str,
    deploy: bool,
    deploy_mode: str,
    serving_name: str,
    serving_namespace: str,
    serving_gpus: int,
    max_lora_rank: int,
    pvc_name: str,
    data_root: str,
    deploy_timeout_s: int,
    manifest: Output[Artifact],
    deployment: Output[Artifact],
):
    """Check the adapter is servable by vLLM, build the InferenceService, then deploy it.

    The servability check runs first (no DoRA, no ``modules_to_save``, rank within
    ``max_lora_rank``, target modules vLLM supports). The InferenceService uses the Hugging
    Face serving runtime with ``--backend=vllm``, LoRA enabled, the adapter registered as a
    LoRA module under the registered model's name, storage from the PVC and GPU resources; it
    is validated against the InferenceService CRD schema before anything is applied.

    ``deploy_mode=kserve`` (and ``deploy=true``): apply it, wait for Ready, and smoke-test the
    OpenAI-compatible completions endpoint with the adapter's model name.
    ``deploy_mode=local``: load base + adapter with transformers and generate for a few prompts,
    failing if the adapter changes nothing. ``deploy=false``: stop after writing the manifest.

    Outputs: ``manifest`` (inferenceservice.yaml) and ``deployment`` (deployment.json:
    servability report, mode, status, endpoint or sample generations).
    """
    import json
    import os

    from llmft.components.lib.deployment import DeployRequest, deploy_promoted

    with open(os.path.join(registration.path, "registration.json")) as fh:
        registered = json.load(fh)
    request = DeployRequest(
        adapter_dir=promoted.metadata["path"],
        base_model=model,
        adapter_name=registered["model_name"],
        version=str(registered["version"]),
        deploy=deploy,
        mode=deploy_mode,
        name=serving_name,
        namespace=serving_namespace,
        gpus=serving_gpus,
        max_lora_rank=max_lora_rank,
        pvc_name=pvc_name,
        data_root=data_root,
        timeout_s=deploy_timeout_s,
    )
    os.makedirs(manifest.path, exist_ok=True)
    result = deploy_promoted(request, manifest_path=os.path.join(manifest.path, "inferenceservice.yaml"))

    os.makedirs(deployment.path, exist_ok=True)
    with open(os.path.join(deployment.path, "deployment.json"), "w") as fh:
        json.dump(result, fh, indent=2, sort_keys=True, default=str)
    deployment.metadata.update({"mode": deploy_mode, "status": result["status"]})
    manifest.metadata.update({"name": serving_name, "path": os.path.join(manifest.path, "inferenceservice.yaml")})
    print(f"deploy ({deploy_mode}): {result['status']}")
