"""Step 7: register the promoted adapter in the MLflow Model Registry."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Model, Output

from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def register_model(
    plan: Input[Artifact],
    promoted: Input[Model],
    evaluation: Input[Artifact],
    run: Input[Model],
    tokenized: Input[Dataset],
    serving: Input[Artifact],
    task_name: str,
    registration: Output[Artifact],
):
    """Register the promoted adapter in MLflow, as a child of the pipeline run's MLflow run; or record why not.

    The registration run (params, metrics, evaluation.json, promotion.json, serving.json) is a child of
    ``pipeline-<run_id>`` (the train and evaluate steps' runs are its siblings); the model version is created
    from the run that trained the adapter, where the adapter is logged as an MLflow Model (transformers
    flavour, PEFT adaptor; ``mlflow.transformers.load_model("models:/<name>/<version>")`` loads base + adapter).
    The version carries lineage tags (pipeline run id, dataset hash = the tokenize cache key,
    base model, checkpoint) and the serving form (``llmft.served_form`` lora or merged,
    ``llmft.serving_reason``; serving.json and the merged model's export manifest are logged with
    the run, the merged weights are not). The alias ``champion`` moves to it only when its ``promote_metric``
    (eval perplexity by default, or a task score) beats the current champion's; the promote step's reason is
    the tag ``llmft.promotion_reason`` and the task scores are metrics of the run and ``llmft.eval.*`` tags.
    A retried task reuses the run and version it created before
    (tag ``llmft.registration_key = <run_id>/<task_name>``), so retries never duplicate.

    With Langfuse configured, the version carries ``llmft.langfuse.*`` tags (the training trace,
    the comparison's dataset run) and the training trace gets a ``registered in MLflow`` event.

    The tracking server is the plan's ``mlflow_tracking_uri`` when set, else ``MLFLOW_TRACKING_URI``
    from the environment; credentials come only from the Secret named by ``mlflow_secret``. Neither set
    (MLflow is optional): nothing is registered, registration.json says ``registered: false`` and why, and
    the deploy step serves the promoted adapter. A full tracking or artifact store exits 200 naming it.

    Outputs: ``registration`` (registration.json; metadata ``registered``, ``version``, ``is_champion``,
    ``model_uri``).
    """
    import json
    import os
    from pathlib import Path

    from llmft.components.lib.plan.schema import read_plan
    from llmft.components.lib.registry.mlflow_registry import (
        Lineage,
        register_adapter,
        registration_from_run,
        registry_client,
    )
    from llmft.components.lib.registry.register_step import not_registered, registry_store_faults
    from llmft.components.lib.serving.serving_form import EXPORT_MANIFEST_FILE, FORM_FILE, read_form
    from llmft.components.lib.step_exit import step_outcome
    from llmft.trainer.io import TRAINING_MANIFEST

    def read(artifact, name):
        with open(os.path.join(artifact.path, name)) as fh:
            return json.load(fh)

    with step_outcome("register-model"):
        run_plan = read_plan(plan.path)
        registry = run_plan.registry
        form = read_form(serving.path)
        if not registry.enabled:
            facts = not_registered(registry.model_name)
        else:
            lineage = Lineage(
                pipeline_run_id=run_plan.run_id,
                task=task_name,
                dataset_hash=str(tokenized.metadata["cache_key"]),
                base_model=run_plan.trainer.model,
                dataset=run_plan.data.dataset,
                checkpoint=str(promoted.metadata["checkpoint"]),
            )
            extras = (
                Path(evaluation.path) / "evaluation.json",
                Path(promoted.path) / "promotion.json",
                Path(run.path) / TRAINING_MANIFEST,
                Path(serving.path) / FORM_FILE,
                Path(serving.path) / EXPORT_MANIFEST_FILE,  # merged form only (a missing file is skipped)
            )
            evaluated = read(evaluation, "evaluation.json")
            promotion = Path(promoted.path) / "promotion.json"
            reg = registration_from_run(
                promoted_dir=promoted.metadata["path"],
                evaluation=evaluated,
                training_manifest=read(run, TRAINING_MANIFEST),
                model_name=registry.model_name,
                experiment=registry.experiment,
                lineage=lineage,
                extra_artifacts=extras,
                tags=form.tags(),
                promotion=read(promoted, "promotion.json") if promotion.is_file() else None,
            )
            mlflow_secret = next((s.name for s in run_plan.task_secrets if s.kind == "mlflow"), "")
            client = registry_client(registry.tracking_uri or None, mlflow_secret)
            uri = registry.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
            with registry_store_faults(client, uri, registry.experiment):
                facts = register_adapter(reg, client=client)
            from llmft.components.lib.evaluation.comparison import record_registration  # into the Langfuse trace

            facts["langfuse_linked"] = record_registration(facts, evaluated, registry.tracking_uri)
    facts["served_form"] = form.form

    os.makedirs(registration.path, exist_ok=True)
    with open(os.path.join(registration.path, "registration.json"), "w") as fh:
        json.dump(facts, fh, indent=2, sort_keys=True)
    registration.metadata.update(
        {
            "registered": facts["registered"],
            "model_name": facts["model_name"],
            "version": facts["version"],
            "is_champion": facts["is_champion"],
            "run_id": facts.get("run_id"),
            "model_uri": facts.get("model_uri"),
        }
    )
    if facts["registered"]:
        name, version, uri = facts["model_name"], facts["version"], facts["model_uri"]
        print(f"registered {name} version {version} ({uri}): {facts['alias_reason']}")
    else:
        print(f"not registered: {facts['reason']}")
