"""`llm_finetune_pipeline`: plan -> raw dataset -> validated JSONL -> packed shards -> fine-tune ->
evaluate -> promote -> [promoted:] serving form (LoRA, or merged) -> register in MLflow -> deploy to KServe vLLM,
then the run summary (Markdown) on either branch of the promote decision.

Every form of the pipeline is built here, from one definition (:func:`build_pipeline`): the full one
(``llm-finetune``), the HPO one (``llm-finetune-hpo``, llmft/pipelines/llm_finetune_hpo.py), their minimal
forms (``-minimal``: eleven run parameters, twelve with the sweep's, the others compiled in) and the form
kfp.local runs. Which parameters a form offers, with their types, defaults and descriptions, comes from their
one declaration (``PipelineParameters``, llmft/components/lib/plan/parameters.py): KFP's decorator reads the pipeline
function's ``inspect.signature`` and its docstring's Args, so they reach the compiled YAML and the KFP UI.
The others are passed to the plan step as the constants they were compiled with. The first task,
``plan-run``, checks them all and writes plan.json; every later task takes the plan plus its data artifacts.

The platform settings are applied here, once, from each step's record (llmft/components/lib/plan/steps.py):

* the data/checkpoint PVC (``volume_pvc_name``) is mounted at ``/data`` in every task, whose container runs as
  the images' uid and gid (``set_security_context``: honoured from KFP backend 2.16, ignored before, where
  the image's ``USER`` gives the same uid; the volume's root must belong to it: lib/plan/volume_access.py);
* CPU and memory requests and limits of every task come from the ``step_*`` parameters of its resource group
  (resolved by the KFP backend at run time, 2.4 onwards);
* the Secrets named by ``hf_token_secret`` / ``mlflow_secret`` / ``langfuse_secret`` / ``s3_secret`` are mounted
  as environment variables into the tasks that need them (lib/plan/steps.py), without ``optional`` (ignored by
  KFP backends before 2.15, kubeflow/pipelines#12216); like the evaluate task's ``gpu_node_selector`` they are fixed
  when compiling (``llmft pipeline compile ... hf_token_secret=NAME``) and are no run parameters, because
  backends before 2.5 cannot take a Secret name or a node selector from a parameter;
* the train task has a timeout and retries (it resumes from the newest checkpoint), prepare and tokenize
  retries (exit 200 is a transient fault); the form kfp.local runs retries nothing (:func:`local_pipeline`);
* serving form, register and deploy run under ``dsl.If`` on the promote step's ``decision`` output: a gate
  that refuses (the adapter does not beat the base model) is a decision, not a failure, so the run ends green
  with the reason in the promote step's output and the run summary (``summarize-run``, on both branches);
* the steps run inside a ``dsl.ExitHandler`` whose exit task (``cleanup-run``) deletes the run's
  unfinished jobs and Experiments when the run fails (llmft/components/lib/jobs/cleanup.py).

No pipeline parameter is a secret. ``llmft pipeline compile [--hpo] [--minimal]`` writes the YAML;
``llmft pipeline run-local`` runs it here through kfp.local.
"""

# No `from __future__ import annotations`: KFP reads the real parameter annotations.
import inspect
from collections.abc import Mapping
from typing import Any

from kfp import compiler, dsl, kubernetes
from kfp.dsl.graph_component import GraphComponent

from llmft.components.cleanup import cleanup_run
from llmft.components.deploy import deploy_adapter
from llmft.components.evaluate import evaluate_perplexity
from llmft.components.images import IMAGE_UID, all_images
from llmft.components.lib.contracts.choices import PROMOTED, SWEEP_TASK_TIMEOUT_S, TRAIN_TASK_TIMEOUT_S
from llmft.components.lib.contracts.pod_parts import GPU_TOLERATION
from llmft.components.lib.contracts.schema import DATA_MOUNT
from llmft.components.lib.plan.checks import SECRET_PARAMETERS, compiled_settings, parse_node_selector, parse_secret
from llmft.components.lib.plan.forms import Form, renamed
from llmft.components.lib.plan.parameters import PARAMETERS, Parameter, compile_time_defaults
from llmft.components.lib.plan.steps import RESOURCE_PARAMETERS, STEP, task_order
from llmft.components.plan import plan_run
from llmft.components.prepare_dataset import prepare_dataset
from llmft.components.promote import promote_best_checkpoint
from llmft.components.register import register_model
from llmft.components.serving_form import choose_serving_form
from llmft.components.summarize import summarize_not_promoted, summarize_run
from llmft.components.sweep import sweep_hyperparameters
from llmft.components.tokenize_dataset import tokenize_dataset
from llmft.components.train import train_model
from llmft.trainer.errors import ConfigError

DESCRIPTION = "Fine-tune an LLM adapter on Kubeflow and serve it with KServe + vLLM"
TASK_ORDER = task_order(hpo=False)
"""The tasks of a promoted run, in the order they run (inside the exit handler group EXIT_GROUP): lib/plan/steps.py
STEPS. Serving form, register, deploy and the first summary run under ``dsl.If(decision == PROMOTED)``; a run the
gate refused runs NOT_PROMOTED_SUMMARY instead."""
NOT_PROMOTED_SUMMARY = "summarize-not-promoted"
"""The summary task of the ``dsl.Else`` branch."""
EXIT_GROUP = "exit-handler-1"
"""The dsl.ExitHandler group holding the pipeline's body; CLEANUP_TASK runs after it, whatever its outcome."""
CLEANUP_TASK = "cleanup-run"

TRAIN_RETRIES = 2
"""Retries of the train task; each resumes from the newest complete checkpoint."""
DATA_RETRIES = 2
"""Retries of prepare and tokenize, which exit 200 on a transient fault (the hub did not answer, a full or
read-only disk) and say it is retried; a retry of a permanent failure (exit 1) ends at once
(llmft/components/lib/task_attempts.py)."""
SWEEP_RETRIES = 2
"""Retries of the sweep task; a retry re-attaches to the same Experiment (its name derives from the run id)."""


# --- the parameter list, derived from the declarations ---------------------------------------


def fixed_values(form: Form, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """name -> compiled value of every parameter the form's plan reads: the declared default, the compile-time
    defaults (images), then ``defaults`` (older names accepted); the offered ones are their run parameters'
    defaults."""
    known = {p.name: p for p in PARAMETERS if form.has(p)}
    given = renamed(defaults or {})
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"unknown pipeline parameter(s) {unknown}")
    values = {**{n: p.default for n, p in known.items()}, **compile_time_defaults(), **given}
    return {name: _typed(known[name], value) for name, value in values.items()}


def _typed(parameter: Parameter, value: Any) -> Any:
    """An int given for a float parameter becomes a float (KFP's type check is strict)."""
    return value if isinstance(value, parameter.type) else parameter.type(value)


def pipeline_signature(form: Form, fixed: Mapping[str, Any]) -> inspect.Signature:
    """The form's run parameters, in declaration order, with their compiled values as defaults."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature(
        [inspect.Parameter(p.name, kind, default=fixed[p.name], annotation=p.type) for p in form.offered()]
    )


def pipeline_docstring(description: str, form: Form) -> str:
    """``description`` plus an Args section with each run parameter's declared description (KFP parses it into
    the compiled YAML's parameter descriptions)."""
    lines = [description, "", "Args:"]
    lines += [f"    {p.name}: {form.description(p)}" for p in form.offered()]
    return "\n".join(lines) + "\n"


class Pipeline(GraphComponent):
    """A compiled-in-Python pipeline whose callers (kfp.local, a pipeline that calls this one) may still use a
    parameter's older name: it is renamed, with a RenamedParameterWarning, before KFP checks the names."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **renamed(kwargs))


def build_pipeline(
    *, hpo: bool = False, minimal: bool = False, local: bool = False, defaults: Mapping[str, Any] | None = None
) -> Pipeline:
    """The pipeline (a KFP GraphComponent) of one :class:`Form`. ``defaults`` replace parameter defaults: of a
    run parameter, its default; of any other (the compile-time ones: Secrets, the evaluate node selector; those
    a minimal form leaves out), the value compiled in."""
    form = Form(hpo=hpo, minimal=minimal, local=local)
    fixed = fixed_values(form, defaults)
    signature = pipeline_signature(form, fixed)
    name = form.pipeline_name
    description = (HPO_DESCRIPTION if hpo else DESCRIPTION) + (MINIMAL_NOTE if minimal else "")

    def pipeline(*args, **kwargs):
        values = {**fixed, **signature.bind(*args, **kwargs).arguments}  # run parameters are pipeline channels
        add_steps(values, fixed, pipeline_name=name, hpo=hpo)

    pipeline.__signature__ = signature  # type: ignore[attr-defined]  # inspect.signature (so KFP) reads it
    pipeline.__doc__ = pipeline_docstring(description, form)
    pipeline.__name__ = pipeline.__qualname__ = name.replace("-", "_") + "_pipeline"
    component = dsl.pipeline(name=name, description=description)(pipeline)
    component.__class__ = Pipeline  # the same object, its calls renaming older names first
    return _without_retries(component) if local else component


# --- the steps --------------------------------------------------------------------------------


def apply_platform(task: dsl.PipelineTask, step: str, values: Mapping, static: Mapping) -> dsl.PipelineTask:
    """Apply the step's record (lib/plan/steps.py): mount the PVC at /data as the images' uid (the volume's
    owner), set CPU/memory requests and limits from its resource group's parameters, mount its Secrets
    (compile-time names, required keys), and place a GPU step on GPU nodes."""
    record = STEP[step]
    image = task.component_spec.implementation.container.image
    if image != all_images()[record.image]:
        raise ConfigError(f"step {step}: its component runs on {image}, its record says the {record.image} image")
    kubernetes.mount_pvc(task, pvc_name=values["volume_pvc_name"], mount_path=DATA_MOUNT)
    kubernetes.set_security_context(task, run_as_user=IMAGE_UID, run_as_group=IMAGE_UID, run_as_non_root=True)
    cpu, memory = RESOURCE_PARAMETERS[record.resources]
    task.set_cpu_request(values[cpu]).set_cpu_limit(values[cpu])
    task.set_memory_request(values[memory]).set_memory_limit(values[memory])
    for secret in task_secrets(step, static):
        kubernetes.use_secret_as_env(task, secret_name=secret.name, secret_key_to_env={k: k for k in secret.keys})
    if record.gpus:
        task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(record.gpus)
        for key, value in parse_node_selector(static["gpu_node_selector"]).items():
            kubernetes.add_node_selector(task, key, value)
        kubernetes.add_toleration(
            task, key=GPU_TOLERATION.key, operator=GPU_TOLERATION.operator, effect=GPU_TOLERATION.effect
        )
    task.set_caching_options(False)  # our own content-addressed caches decide reuse
    return task


def task_secrets(step: str, static: Mapping) -> list:
    """The Secrets (SecretMount) the compiled pipeline mounts into ``step``."""

    mounts = [parse_secret(kind, static[SECRET_PARAMETERS[kind]]) for kind in STEP[step].secrets]
    return [m for m in mounts if m is not None]


def add_steps(values: Mapping, static: Mapping, *, pipeline_name: str, hpo: bool) -> None:
    """The body inside a dsl.ExitHandler whose exit task deletes what a failed or cancelled run left
    running (llmft/components/cleanup.py)."""
    cleanup = cleanup_run(run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER).set_display_name("clean up after the run")
    cleanup.set_cpu_request(values["step_cpu"]).set_cpu_limit(values["step_cpu"])
    cleanup.set_memory_request(values["step_memory"]).set_memory_limit(values["step_memory"])
    cleanup.set_caching_options(False)
    with dsl.ExitHandler(cleanup):
        add_body(values, static, pipeline_name=pipeline_name, hpo=hpo)


def add_body(values: Mapping, static: Mapping, *, pipeline_name: str, hpo: bool) -> None:
    """plan -> prepare -> tokenize [-> sweep] -> train -> evaluate -> promote -> serving form -> register -> deploy."""
    plan_task = plan_run(
        **values, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, compiled=compiled_settings(pipeline_name, static)
    )
    plan = apply_platform(plan_task.set_display_name("plan the run"), "plan-run", values, static).outputs["plan"]

    prepare = prepare_dataset(plan=plan)
    apply_platform(prepare.set_display_name("prepare dataset"), "prepare-dataset", values, static)
    tokenize = tokenize_dataset(plan=plan, prepared=prepare.outputs["prepared"])
    apply_platform(tokenize.set_display_name("tokenize to PVC"), "tokenize-dataset", values, static)
    for data_task in (prepare, tokenize):
        data_task.set_retry(num_retries=DATA_RETRIES, backoff_duration="60s", backoff_factor=2.0)
    tokenized = tokenize.outputs["tokenized"]

    best = add_sweep_step(plan, tokenized, values, static).outputs["Output"] if hpo else ""
    train = train_model(plan=plan, tokenized=tokenized, sweep_best=best)
    apply_platform(
        train.set_display_name("train" + (" with the best hyperparameters" if hpo else "")),
        "train-model",
        values,
        static,
    )
    train.set_retry(num_retries=TRAIN_RETRIES, backoff_duration="60s", backoff_factor=2.0)
    kubernetes.set_timeout(train, TRAIN_TASK_TIMEOUT_S)
    add_release_steps(plan, prepare.outputs["prepared"], tokenized, train.outputs["run"], values, static)


def add_sweep_step(plan, tokenized, values: Mapping, static: Mapping) -> dsl.PipelineTask:
    """The HPO pipeline's sweep task; its output (the best key=value overrides) goes to train."""
    sweep = sweep_hyperparameters(plan=plan, tokenized=tokenized)
    apply_platform(sweep.set_display_name("sweep hyperparameters (Katib)"), "sweep-hyperparameters", values, static)
    sweep.set_retry(num_retries=SWEEP_RETRIES, backoff_duration="60s", backoff_factor=2.0)
    kubernetes.set_timeout(sweep, SWEEP_TASK_TIMEOUT_S)
    return sweep


def add_release_steps(plan, prepared, tokenized, run, values: Mapping, static: Mapping) -> None:
    """evaluate -> promote -> [promoted: serving form (LoRA or merged) -> register in MLflow -> deploy to KServe
    vLLM] -> the run summary (both branches)."""
    evaluate = evaluate_perplexity(plan=plan, tokenized=tokenized, run=run)
    apply_platform(evaluate.set_display_name("evaluate perplexity"), "evaluate-perplexity", values, static)
    evaluation = evaluate.outputs["evaluation"]

    promote = promote_best_checkpoint(plan=plan, evaluation=evaluation)
    apply_platform(promote.set_display_name("promote best checkpoint"), "promote-best-checkpoint", values, static)
    promoted = promote.outputs["promoted"]
    facts = dict(plan=plan, prepared=prepared, tokenized=tokenized, run=run, evaluation=evaluation, promoted=promoted)

    with dsl.If(promote.outputs["decision"] == PROMOTED, name="promoted"):
        serving, registration, deployment = add_serving_steps(
            plan, promoted, evaluation, tokenized, run, values, static
        )
        summary = summarize_run(**facts, serving=serving, registration=registration, deployment=deployment)
        apply_platform(summary.set_display_name("run summary"), "summarize-run", values, static)
    with dsl.Else(name="not-promoted"):
        summary = summarize_not_promoted(**facts)
        apply_platform(summary.set_display_name("run summary (not promoted)"), NOT_PROMOTED_SUMMARY, values, static)


def add_serving_steps(plan, promoted, evaluation, tokenized, run, values: Mapping, static: Mapping):
    """serving form -> register -> deploy; returns their (serving, registration, deployment) artifacts."""
    form = choose_serving_form(plan=plan, promoted=promoted)
    apply_platform(form.set_display_name("serving form (LoRA or merged)"), "choose-serving-form", values, static)
    serving = form.outputs["serving"]

    register = register_model(
        plan=plan,
        promoted=promoted,
        evaluation=evaluation,
        run=run,
        tokenized=tokenized,
        serving=serving,
        task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
    )
    apply_platform(register.set_display_name("register in MLflow"), "register-model", values, static)
    register.set_retry(num_retries=2, backoff_duration="30s")  # idempotent: a retry reuses the version

    deploy = deploy_adapter(
        plan=plan, promoted=promoted, registration=register.outputs["registration"], serving=serving
    )
    apply_platform(deploy.set_display_name("deploy to KServe vLLM"), "deploy-adapter", values, static)
    return serving, register.outputs["registration"], deploy.outputs["deployment"]


HPO_DESCRIPTION = (
    "Sweep the fine-tuning hyperparameters with Katib, then fine-tune, evaluate, register and serve the best adapter"
)
MINIMAL_NOTE = " (minimal form: the other parameters are compiled in; docs/pipeline-parameters.md)"

llm_finetune_pipeline = build_pipeline()
"""The pipeline with the defaults of this environment (images from llmft/components/images.py)."""


def local_pipeline(*, hpo: bool = False, defaults: Mapping[str, Any] | None = None) -> Pipeline:
    """The pipeline as kfp.local runs it (``llmft pipeline run-local``): its kfp.local form, the same tasks, no
    retries (:func:`build_pipeline` ``local=True``)."""
    return build_pipeline(hpo=hpo, local=True, defaults=defaults)


def _without_retries(pipeline: Pipeline) -> Pipeline:
    """kfp.local retries a failed task whatever its exit code, after the backoff (kfp 2.17.3
    ``kfp/local/orchestrator/task_executor.py`` 124-175): a permanent failure (exit 1: bad data, a NaN abort, a
    cluster-only backend) ran twice more, 60 s and 120 s later, and a local trainer trained again each time.
    On a cluster the retries stay: a lost launcher, a transient fault (exit 200)."""
    spec = pipeline.pipeline_spec
    for component in [spec.root, *spec.components.values()]:
        for task in component.dag.tasks.values():
            task.ClearField("retry_policy")
    return pipeline


def compile_pipeline(
    output: str, *, hpo: bool = False, minimal: bool = False, defaults: Mapping[str, Any] | None = None
) -> str:
    """Compile the pipeline (``defaults`` replace parameter defaults) to ``output`` (YAML); return the path."""

    plain = not (hpo or minimal or defaults)
    pipeline = llm_finetune_pipeline if plain else build_pipeline(hpo=hpo, minimal=minimal, defaults=defaults)
    compiler.Compiler().compile(pipeline, package_path=output)
    return output
