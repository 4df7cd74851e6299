"""The run plan: every pipeline parameter resolved and checked once, written as ``plan.json``.

The first task of both pipelines (``plan-run``, llmft/components/plan.py) hands its parameters to
:func:`build_plan`, which checks them all (before any GPU is requested) and returns a
:class:`RunPlan`: a typed tree that every later task reads back with :func:`read_plan`.
Nothing after the plan takes a knob; each task takes the plan plus its data artifacts.

A knob's whole route, e.g. ``finetune_lora_r`` (one name per layer, one typed value; grep the name)::

    components/lib/plan/parameters.py PipelineParameters.finetune_lora_r: int = _p(16, "LoRA rank ...")
                                                                  the declaration: type, default, description, forms
    llmft/pipelines/llm_finetune.py   build_pipeline                 the pipeline's run parameter (KFP signature)
    llmft/components/plan.py          plan_run(..., finetune_lora_r: int = 16, ...) -> PipelineParameters(
                                          finetune_lora_r=finetune_lora_r, ...)    (generated from the declaration)
    llmft/trainer/config.py           LoraConfig.r: int = _f(16, ..., Setting("lora_r", pipeline="finetune_lora_r"))
                                                                  the trainer field names the parameter that sets it
    components/lib/plan/build.py      trainer_settings: lora.r = p.finetune_lora_r (TRAINER_PARAMETERS)
                                          -> TrainConfig.lora.r (int), validated once: TrainerPlan.config
    components/lib/plan/step.py       write_run_config(plan)         -> <run_dir>/config.yaml ``lora: r: 16``
    llmft/components/train.py         llmft train --config <run_dir>/config.yaml data=<tokenized>
    llmft/trainer/model.py            load_model -> apply_lora(model, cfg.lora): peft LoraConfig(r=lora.r, ...)

Only what a later step decides travels as ``key=value`` on the trainer's command line: the
tokenized data's path (tokenize's cache key), a sweep's best values, and Katib's trial values.

Parameters that the compiled YAML applies to the KFP tasks themselves (the Secrets the tasks
mount, the evaluate task's GPU node selector) are fixed when the pipeline is compiled: KFP
backends before 2.5 cannot take a Secret or node-selector value from a parameter
(backend/src/v2/driver/driver.go at 2.4.0 reads only the static ``secretName`` and ``labels``). They are
no run parameters (declared ``offer="compile"``): the pipeline passes the compiled values to the plan step
as constants, so the tasks and the plan cannot disagree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Mapping
from typing import Any

from llmft.components.lib.contracts.choices import (
    DEPLOY_POLICIES,
    SERVING_MODES,
    SWEEP_TASK_TIMEOUT_S,
    TRAIN_TASK_TIMEOUT_S,
)
from llmft.components.lib.contracts.run_jobs import JOB_WAIT_GRACE_S, RUN_ID_LABEL, job_name, on_kfp_cluster, run_label
from llmft.components.lib.contracts.schema import (
    PLAN_SCHEMA_VERSION,
    DataLayout,
    DataPlan,
    Images,
    JobPlan,
    RegistryPlan,
    RunPlan,
    SecretMount,
    ServingPlan,
    SweepPlan,
    TrainerPlan,
)
from llmft.components.lib.jobs.backends import backend_for
from llmft.components.lib.jobs.grace import grace_period_s
from llmft.components.lib.jobs.katib_sweep import DEFAULT_TRIAL_OVERRIDES, experiment_name
from llmft.components.lib.jobs.trainjob_spec import parse_runtime_ref
from llmft.components.lib.plan import checks as checks
from llmft.components.lib.plan.checks import check_resources, check_tracking, extra_override_list, parse_node_selector
from llmft.components.lib.plan.eval_plan import eval_plan
from llmft.components.lib.plan.parameters import PipelineParameters
from llmft.components.lib.plan.steps import mounted_secret_kinds
from llmft.components.lib.plan.volume_space import check_volume_space, run_footprint
from llmft.trainer.config import RUN_CONFIG_FILE, iter_settings
from llmft.trainer.config_load import config_to_yaml, nest_dotted, resolve_config
from llmft.trainer.errors import ConfigError
from llmft.trainer.io import write_owned_file
from llmft.trainer.storage import human

# --- the builder ------------------------------------------------------------------------------


def build_plan(
    values: Mapping[str, Any] | PipelineParameters,
    *,
    run_id: str,
    compiled: str = "",
    environ: Mapping[str, str] | None = None,
) -> RunPlan:
    """Check every parameter and resolve the run; raises ConfigError naming the first bad one.

    ``compiled`` is the JSON the pipeline passes (its name, whether it sweeps, the compile-time values);
    ``environ`` (default os.environ) tells a cluster task from kfp.local."""

    p = values if isinstance(values, PipelineParameters) else PipelineParameters.from_values(values)
    settings = json.loads(compiled) if compiled else {}
    on_cluster = on_kfp_cluster(environ)
    layout = DataLayout(p.volume_path)
    run_id = checks.check_run_id(run_id)
    checks.check_general(p, on_cluster)
    images = Images(
        trainer=checks.check_image(p.training_image), serving_runtime=checks.check_runtime(p.serving_runtime)
    )
    secrets = {kind: checks.parse_secret(kind, getattr(p, param)) for kind, param in checks.SECRET_PARAMETERS.items()}
    mounted = mounted_secret_kinds()  # the Secrets the compiled pipeline mounts into its own tasks
    trainer = trainer_plan(p, layout, run_id)
    config = trainer.config
    pipeline = settings.get("pipeline", "llm-finetune")
    hpo = bool(settings.get("hpo", pipeline.endswith("-hpo")))
    trials = tuple(shlex.split(p.hpo_trial_overrides or "")) if hpo else ()
    checks.check_remote_code(config, settings, trials)
    plan = RunPlan(
        schema_version=PLAN_SCHEMA_VERSION,
        pipeline=pipeline,
        run_id=run_id,
        on_cluster=on_cluster,
        layout=layout,
        images=images,
        data=_data_plan(p, layout, run_id),
        trainer=trainer,
        job=job_plan(p, layout, run_id, images, secrets),
        registry=_registry_plan(p, layout, run_id, on_cluster, environ),
        serving=_serving_plan(p, layout, run_id, images, secrets),
        sweep=_sweep_plan(p, layout, run_id) if hpo else None,
        evaluation=eval_plan(p, layout, os.environ if environ is None else environ),
        task_secrets=tuple(secrets[kind] for kind in checks.SECRET_PARAMETERS if kind in mounted and secrets[kind]),
        task_resources=checks.task_resources(p),
        parameters=p.as_dict(),
    )
    form_note = checks.check_serving(plan, config)
    if form_note:
        plan = dataclasses.replace(plan, serving=dataclasses.replace(plan.serving, form_note=form_note))
    if plan.sweep is not None:
        checks.check_sweep(plan, p.serving_max_lora_rank)

    note = check_volume_space(plan, config, p.volume_path)  # the run's checkpoints must fit the mounted volume
    if note:
        print(note, flush=True)
    return _with_grace(plan, config)


def _with_grace(plan: RunPlan, config) -> RunPlan:
    """The training pods' grace period, sized from the checkpoint's estimated size (jobs/grace.py)."""
    footprint, why_not = run_footprint(plan, config)
    grace = grace_period_s(footprint.checkpoint if footprint else None)
    print(
        f"training pods: terminationGracePeriodSeconds {grace} ("
        + (f"a {human(footprint.checkpoint)} checkpoint" if footprint else f"checkpoint size unknown: {why_not}")
        + ")",
        flush=True,
    )
    return dataclasses.replace(plan, job=dataclasses.replace(plan.job, termination_grace_s=grace))


def _data_plan(p: PipelineParameters, layout: DataLayout, run_id: str) -> DataPlan:
    return DataPlan(
        dataset=p.dataset,
        format=p.dataset_format,
        split=p.dataset_split,
        config=p.dataset_config,
        columns=checks.check_dataset_columns(p),
        val_fraction=p.dataset_val_fraction,
        max_reject_fraction=p.dataset_max_reject_fraction,
        seed=p.finetune_seed,
        max_length=p.finetune_max_length,
        packing=p.finetune_packing,
        prepared_dir=layout.prepared(run_id),
    )


TRAINER_PARAMETERS = {key: setting.pipeline for key, setting in iter_settings() if setting.pipeline}
"""Trainer key -> the pipeline parameter that sets it (named in a refusal): declared on the trainer's fields
(llmft/trainer/config.py, ``Setting(name, pipeline="finetune_lora_r")``), never listed here."""
PIPELINE_SETTINGS = tuple(TRAINER_PARAMETERS.values())
"""The pipeline parameters that are trainer settings."""


def trainer_settings(p: PipelineParameters, run_dir: str, run_id: str) -> dict[str, Any]:
    """The only place pipeline parameters become trainer settings (``finetune_lora_r`` -> ``lora.r``, by
    :data:`TRAINER_PARAMETERS`), typed. ``finetune_epochs`` counts only without ``finetune_max_steps``; an
    empty ``mlflow_experiment`` keeps the trainer's default."""
    values = {key: getattr(p, name) for key, name in TRAINER_PARAMETERS.items()}
    values["max_steps"] = max(p.finetune_max_steps, 0)
    if p.finetune_max_steps > 0:
        del values["epochs"]
    if not p.mlflow_experiment:
        del values["observe.mlflow_experiment"]
    values |= {
        "output_dir": run_dir,
        "resume": "auto",  # a retried task continues from the newest complete checkpoint
        "observe.run_name": f"train-{run_id}",  # a child of the pipeline run's MLflow run (lib/registry/lineage.py)
    }
    return nest_dotted(values)  # target_modules "q_proj,v_proj": the loader makes it a tuple


def trainer_plan(p: PipelineParameters, layout: DataLayout, run_id: str) -> TrainerPlan:
    """The trainer's config, resolved and validated once: the parameters' settings, then ``finetune_overrides``
    (the one key=value parser); ``data`` stays unset: only tokenize knows its path (its cache key)."""

    run_dir = layout.run_dir(run_id)
    user = extra_override_list(p.finetune_overrides, "finetune_overrides")
    names = {key: f"pipeline parameter `{name}`" for key, name in TRAINER_PARAMETERS.items()}
    try:
        config, _ = resolve_config(
            {**trainer_settings(p, run_dir, run_id), "data": PENDING_DATA},
            user,
            source_name="pipeline training parameters",
            names=names,
            override_label="finetune_overrides",
        )
    except ConfigError as exc:
        raise ConfigError(f"pipeline training parameters: {exc}") from None
    config = dataclasses.replace(config, data="")
    return TrainerPlan(config=config, config_path=f"{run_dir}/{RUN_CONFIG_FILE}", user_overrides=tuple(user))


PENDING_DATA = "<tokenized>"
"""Stands in for the tokenized data while the plan validates (tokenize names the folder later)."""


def write_run_config(plan: RunPlan) -> str:
    """Write the plan's trainer config as ``<run_dir>/config.yaml`` (atomic: temp + rename). A retried
    plan task replaces a config.yaml llmft wrote (same parameters, same text); a file llmft did not
    write, or a symlink, is refused (trainer.io.write_owned_file: OutputNotOursError, exit 1)."""
    header = f"the resolved trainer config of run {plan.run_id} (plan step); the train step adds data=<tokenized>"
    write_owned_file(plan.trainer.config_path, config_to_yaml(plan.trainer.config), command=f"pipeline plan: {header}")
    return plan.trainer.config_path


def job_plan(p: PipelineParameters, layout: DataLayout, run_id: str, images: Images, secrets: Mapping) -> JobPlan:
    """The training job's inputs (also the CLI's ``llmft sweep create``, from the same parameters)."""

    env = layout.hf_env()
    job_secrets = [s for s in (secrets.get("hf"), secrets.get("mlflow"), secrets.get("langfuse")) if s is not None]
    if p.mlflow_tracking_uri:  # the parameter wins over the Secret's key
        env["MLFLOW_TRACKING_URI"] = p.mlflow_tracking_uri
        job_secrets = [_without_key(s, "MLFLOW_TRACKING_URI") for s in job_secrets]
    return JobPlan(
        backend=backend_for(p.training_backend).name,  # the registered name, an older one resolved
        name=job_name(run_id),
        num_workers=p.training_workers,
        gpus_per_worker=p.training_gpus_per_worker,
        resources=check_resources(("training_cpu", "training_memory"), p.training_cpu, p.training_memory),
        node_selector=parse_node_selector(p.gpu_node_selector) if p.training_gpus_per_worker else {},
        timeout_s=_task_bounded("training_timeout_s", p.training_timeout_s, TRAIN_TASK_TIMEOUT_S),
        pvc_name=p.volume_pvc_name,
        mount_path=layout.root,
        image=images.trainer,
        env=env,
        secrets=tuple(s for s in job_secrets if s.keys),
        labels={RUN_ID_LABEL: run_label(run_id)},
        runtime=_training_runtime(p.training_runtime),
    )


def _training_runtime(value: str) -> str:

    try:
        parse_runtime_ref(value)
    except ConfigError as exc:
        raise ConfigError(f"pipeline parameter `training_runtime`={value!r}: {exc}") from None
    return value


def _task_bounded(name: str, value: int, task_timeout_s: int) -> int:
    """A wait of ``value`` seconds that must end (plus the launcher's grace after a job's deadline)
    before the KFP task's own timeout, or the task pod would be killed while its job still runs."""

    limit = task_timeout_s - JOB_WAIT_GRACE_S
    if not 0 < value <= limit:
        raise ConfigError(
            f"pipeline parameter `{name}`={value}: must be between 1 and {limit} seconds (the task's own timeout "
            f"{task_timeout_s} s minus {JOB_WAIT_GRACE_S} s), so the job ends before the step that waits for it"
        )
    return value


def _without_key(secret: SecretMount, key: str) -> SecretMount:
    return dataclasses.replace(secret, keys=tuple(k for k in secret.keys if k != key))


def _registry_plan(p: PipelineParameters, layout: DataLayout, run_id: str, on_cluster: bool, environ) -> RegistryPlan:

    enabled = check_tracking(p, on_cluster, os.environ if environ is None else environ)
    return RegistryPlan(
        tracking_uri=p.mlflow_tracking_uri,
        experiment=p.mlflow_experiment,
        model_name=p.mlflow_model_name,
        promote_margin=p.promote_margin,
        promoted_dir=layout.promoted(p.mlflow_model_name, run_id),
        promote_metric=p.promote_metric,
        enabled=enabled,
    )


def _serving_plan(p: PipelineParameters, layout: DataLayout, run_id: str, images: Images, secrets: dict) -> ServingPlan:

    return ServingPlan(
        deploy=p.serving_deploy,
        mode=p.serving_deploy_mode,
        name=p.serving_name,
        namespace=p.serving_namespace,
        gpus=p.serving_gpus,
        resources=check_resources(("serving_cpu", "serving_memory"), p.serving_cpu, p.serving_memory),
        runtime=images.serving_runtime,
        max_lora_rank=p.serving_max_lora_rank,
        timeout_s=p.serving_deploy_timeout_s,
        node_selector=parse_node_selector(p.gpu_node_selector) if p.serving_gpus else {},
        pvc_name=p.volume_pvc_name,
        hf_secret=secrets["hf"],
        deploy_policy=_choice("serving_deploy_policy", p.serving_deploy_policy, DEPLOY_POLICIES),
        serving_mode=_choice("serving_mode", p.serving_mode, SERVING_MODES),
        merged_dir=layout.merged(p.mlflow_model_name, run_id),
        prompts=parse_prompts(p.serving_prompts),
    )


PROMPT_SEPARATOR = " | "


def parse_prompts(text: str) -> tuple[str, ...]:
    """``serving_prompts`` -> the prompts (blank ones dropped)."""
    return tuple(part.strip() for part in text.split(PROMPT_SEPARATOR.strip()) if part.strip())


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"pipeline parameter `{name}`={value!r}: choose one of {', '.join(choices)}")
    return value


def _sweep_plan(p: PipelineParameters, layout: DataLayout, run_id: str) -> SweepPlan:

    name = experiment_name(run_id)
    settings = (
        f"algorithm={p.hpo_algorithm}",
        f"max_trials={p.hpo_max_trials}",
        f"parallel_trials={p.hpo_parallel_trials}",
        f"max_failed_trials={p.hpo_max_failed_trials}",
        *shlex.split(p.hpo_overrides or ""),
    )
    trials = tuple(shlex.split(p.hpo_trial_overrides or "")) or DEFAULT_TRIAL_OVERRIDES
    return SweepPlan(
        backend=p.hpo_backend,
        experiment=name,
        settings=settings,
        trial_overrides=trials,
        timeout_s=_task_bounded("hpo_timeout_s", p.hpo_timeout_s, SWEEP_TASK_TIMEOUT_S),
        workdir=layout.sweep_dir(name),
    )
