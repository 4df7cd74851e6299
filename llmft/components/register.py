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
    from llmft.components.lib.contracts.schema import read_plan
    from llmft.trainer.quiet import quiet_known_noise

    quiet_known_noise()  # the libraries' known noise off the task's log (llmft/trainer/quiet.py)
    from llmft.components.lib.registry.register_step import (
        RegisterInputs,
        register_run,
        registration_line,
        write_registration,
    )
    from llmft.components.lib.serving.serving_form import form_files, read_form
    from llmft.components.lib.step_exit import step_outcome

    with step_outcome("register-model"):
        run_plan = read_plan(plan.path)
        form = read_form(serving.path)
        inputs = RegisterInputs(
            evaluation_dir=evaluation.path,
            promoted_dir=promoted.path,
            run_dir=run.path,
            promoted_adapter=promoted.metadata["path"],
            checkpoint=str(promoted.metadata["checkpoint"]),
            cache_key=str(tokenized.metadata["cache_key"]),
            task_name=task_name,
        )
        facts, evaluated = register_run(run_plan, inputs, form_tags=form.tags(), form_files=form_files(serving.path))
        if evaluated is not None:
            from llmft.components.lib.evaluation.comparison import record_registration  # into the Langfuse trace

            facts["langfuse_linked"] = record_registration(facts, evaluated, run_plan.registry.tracking_uri)
    facts["served_form"] = form.form
    registration.metadata.update(write_registration(facts, registration.path))
    print(registration_line(facts))
