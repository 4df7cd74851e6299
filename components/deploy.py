"""Step 7: deploy the promoted adapter to KServe on the vLLM backend (or check it locally)."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Model, Output
from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def deploy_adapter(
    plan: Input[Artifact],
    promoted: Input[Model],
    registration: Input[Artifact],
    manifest: Output[Artifact],
    deployment: Output[Artifact],
):
    """Check the adapter is servable by vLLM, build the InferenceService, then deploy the champion.

    The servability check runs first (no DoRA, no ``modules_to_save``, rank within
    ``max_lora_rank``, target modules vLLM supports). The InferenceService uses the Hugging
    Face serving runtime with ``--backend=vllm``, LoRA enabled, the adapter registered as a
    LoRA module under the registered model's name and the base model as ``<name>-base``, storage
    from the PVC and GPU resources; it is validated against the InferenceService CRD schema before
    anything is applied.

    Only the champion is served: a version the register step did not make the champion
    (registration.json ``is_champion`` false) is registered but not deployed, unless
    ``deploy_policy=always``.

    ``deploy_mode=kserve`` (and ``deploy=true``): apply it, wait for Ready, and smoke-test the
    OpenAI endpoints: ``/openai/v1/models`` lists both names, and the adapter's greedy completion of
    a fixed prompt is not the base model's.
    ``deploy_mode=local``: load base + adapter with transformers and generate for a few prompts,
    failing if the adapter changes nothing. ``deploy=false``: stop after writing the manifest.

    Outputs: ``manifest`` (inferenceservice.yaml) and ``deployment`` (deployment.json:
    servability report, mode, status, endpoint or sample generations).
    """
    import json
    import os

    from llmft.components.lib.plan import read_plan

    run_plan = read_plan(plan.path)
    run_plan.layout.use_hf_cache()  # deploy_mode=local loads the base model: before transformers is imported
    from llmft.components.lib.deployment import DeployRequest, deploy_promoted

    serving = run_plan.serving
    with open(os.path.join(registration.path, "registration.json")) as fh:
        registered = json.load(fh)
    request = DeployRequest(
        adapter_dir=promoted.metadata["path"],
        base_model=run_plan.trainer.model,
        adapter_name=registered["model_name"],
        version=str(registered["version"]),
        deploy=serving.deploy,
        mode=serving.mode,
        name=serving.name,
        namespace=serving.namespace,
        gpus=serving.gpus,
        max_lora_rank=serving.max_lora_rank,
        pvc_name=serving.pvc_name,
        data_root=run_plan.layout.root,
        timeout_s=serving.timeout_s,
        cpu=serving.resources.cpu,
        memory=serving.resources.memory,
        runtime=serving.runtime,
        node_selector=serving.node_selector,
        hf_secret=serving.hf_secret,
        is_champion=bool(registered.get("is_champion", True)),
        deploy_policy=serving.deploy_policy,
    )
    os.makedirs(manifest.path, exist_ok=True)
    result = deploy_promoted(request, manifest_path=os.path.join(manifest.path, "inferenceservice.yaml"))

    os.makedirs(deployment.path, exist_ok=True)
    with open(os.path.join(deployment.path, "deployment.json"), "w") as fh:
        json.dump(result, fh, indent=2, sort_keys=True, default=str)
    deployment.metadata.update({"mode": serving.mode, "status": result["status"]})
    manifest.metadata.update({"name": serving.name, "path": os.path.join(manifest.path, "inferenceservice.yaml")})
    print(f"deploy ({serving.mode}): {result['status']}")
