"""Step 8: deploy the promoted adapter (or the merged model) to KServe on the vLLM backend (or check it locally)."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Model, Output

from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def deploy_adapter(
    plan: Input[Artifact],
    promoted: Input[Model],
    registration: Input[Artifact],
    serving: Input[Artifact],
    manifest: Output[Artifact],
    deployment: Output[Artifact],
):
    """Serve the form the serving-form step chose: build the InferenceService, then deploy the champion.

    Form ``lora`` (serving.json): the servability check runs first (no DoRA, no ``modules_to_save``,
    rank within ``serving_max_lora_rank``, target modules vLLM supports). The InferenceService uses the
    Hugging Face serving runtime with ``--backend=vllm``, LoRA enabled, the adapter registered as a
    LoRA module under the registered model's name and the base model as ``<name>-base``, storage
    from the PVC and GPU resources. Form ``merged``: the merged model directory alone, served as the
    registered model's name with ``--backend=vllm`` and no LoRA flag. The manifest is validated
    against the InferenceService CRD schema before anything is applied.

    Only the champion is served: a version the register step did not make the champion
    (registration.json ``is_champion`` false or missing) is registered but not deployed, unless
    ``serving_deploy_policy=always``. A run without MLflow (registration.json ``registered: false``) has no champion to
    compare with: the promoted adapter is served, and deployment.json's ``note`` says so.

    ``serving_deploy_mode=kserve`` (and ``serving_deploy=true``): apply it, wait for Ready, and smoke-test the
    OpenAI endpoints: ``/openai/v1/models`` lists both names, and the adapter's greedy completion of
    a fixed prompt is not the base model's (merged: its one name is listed and answers).
    ``serving_deploy_mode=local``: load base + adapter (or the merged model) with transformers and generate
    for a few prompts, failing if the adapter changes nothing. ``serving_deploy_mode=vllm`` (kfp.local): serve the
    manifest's model(s) with a real vLLM from the serving virtualenv (``make serving-venv``), run the same
    smoke test for each prompt, stop it; deployment.json carries ``models`` and ``answers``.
    ``serving_deploy=false``: stop after writing the manifest.

    Outputs: ``manifest`` (inferenceservice.yaml) and ``deployment`` (deployment.json:
    servability report, mode, status, endpoint, sample generations, or vLLM's ``models`` and ``answers``;
    metadata ``endpoint``: the OpenAI chat route of the deployed InferenceService and ``url`` (only when it was
    deployed), ``model``: the name to request, ``status``).
    """
    import json
    import os

    from llmft.components.lib.contracts.schema import read_plan
    from llmft.components.lib.step_exit import step_outcome
    from llmft.trainer.quiet import quiet_known_noise

    quiet_known_noise()  # the libraries' known noise off the task's log (llmft/trainer/quiet.py)

    with step_outcome("deploy-adapter"):
        run_plan = read_plan(plan.path)
        run_plan.layout.use_hf_cache()  # serving_deploy_mode=local loads the base model: before transformers
        # is imported
        from llmft.components.lib.serving.deployment import deploy_promoted, deployment_metadata, plan_deploy_request
        from llmft.components.lib.serving.serving_form import read_form

        form = read_form(serving.path)
        settings = run_plan.serving
        with open(os.path.join(registration.path, "registration.json")) as fh:
            registered = json.load(fh)
        request = plan_deploy_request(
            run_plan,
            adapter_dir=promoted.metadata["path"],
            registered=registered,
            form=form.form,
            model_dir=form.model_dir,
            form_reason=form.reason,
        )
        os.makedirs(manifest.path, exist_ok=True)
        result = deploy_promoted(request, manifest_path=os.path.join(manifest.path, "inferenceservice.yaml"))

    os.makedirs(deployment.path, exist_ok=True)
    with open(os.path.join(deployment.path, "deployment.json"), "w") as fh:
        json.dump(result, fh, indent=2, sort_keys=True, default=str)
    deployment.metadata.update(
        deployment_metadata(result, mode=settings.mode, form=form.form, model=request.adapter_name)
    )
    manifest.metadata.update({"name": settings.name, "path": os.path.join(manifest.path, "inferenceservice.yaml")})
    print(f"deploy ({settings.mode}, {form.form} form): {result['status']}")
