"""The logic of the sweep step: llmft/katib/ composed with the PyTorchJob builder and the cluster module.

llmft/katib/ is a leaf package (it never builds the PyTorchJob nor talks to a cluster itself), so
the composition lives here: :func:`sweep_trial_job` renders the trainer's PyTorchJob with
``${trialParameters.x}`` placeholders (llmft.components.lib.jobs.pytorchjob_spec, the train step's builder),
:func:`build_sweep_experiment` wraps it in the Katib Experiment, and :func:`run_sweep_step`
(the ``sweep_hyperparameters`` component's body, llmft/components/sweep.py) creates it through
``llmft.components.lib.cluster``, waits for it, and returns the best ``key=value`` overrides.
``llmft sweep create|status|best`` use the same functions.

Backend ``local`` runs the same search space through Optuna in the step's process
(``llmft.katib.local_sweep``): what ``llmft pipeline run-local --hpo`` and CPU tests use.

No kfp import here: component bodies import this module inside the KFP executor, whose
runtime ``kfp.dsl`` has no decorators.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmft.components.images import local_trainer_python
from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.contracts.run_jobs import job_name
from llmft.components.lib.contracts.schema import TrainerLaunch
from llmft.components.lib.jobs.backends import Backend, backend_for
from llmft.components.lib.jobs.launcher_pod import delete_on_sigterm, run_owner_reference
from llmft.components.lib.jobs.pytorchjob_spec import build_job_spec
from llmft.components.lib.registry.lineage import sweep_parent_tags
from llmft.katib import local_sweep
from llmft.katib import status as katib_status
from llmft.katib.errors import ExperimentFailed
from llmft.katib.experiment import (
    GROUP,
    PLURAL,
    TRIAL_NAME_PLACEHOLDER,
    VERSION,
    SweepSpec,
    apply_overrides,
    build_experiment,
    trial_overrides,
)
from llmft.katib.experiment_yaml import to_yaml
from llmft.katib.tracking import ParentRun
from llmft.katib.trial_kinds import check_trial_resources, trial_kind
from llmft.katib.webhook_rules import check_experiment
from llmft.trainer.command_line import override_pairs
from llmft.trainer.errors import ConfigError
from llmft.trainer.mlflow_settings import PARENT_RUN_ENV

DEFAULT_TRIAL_OVERRIDES = ("max_steps=200", "eval_every=25", "save_every=0", "eval.max_sequences=512")
"""Fixed trainer settings of every trial when ``hpo_trial_overrides`` is empty: short runs,
several evals (medianstop needs start_step of them)."""
TRIAL_OWNED_KEYS = ("model.name_or_path", "data", "output_dir", "method", "resume", "observe.run_name")
"""Keys each trial sets itself (the searched keys come from the sweep spec)."""


SETTINGS_NOT_CARRIED = ("output_dir", "observe.mlflow_experiment")
"""Of ``settings`` (no config file): the final training's own place, and its MLflow experiment (a trial's
is the sweep's, or the trainer's default)."""


def experiment_name(run_id: str) -> str:
    """A Katib-valid Experiment name (<= 40 chars), stable for a pipeline run so a retry finds it."""
    cleaned = re.sub(r"[^a-z0-9]", "", run_id.lower())[:12]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
    return f"llmft-sweep-{cleaned}-{digest}" if cleaned else f"llmft-sweep-{digest}"


def check_trial_overrides(sweep, fixed_overrides: Sequence[str]) -> None:
    """Refuse fixed trial settings that set a key the sweep sets itself (searched or per trial)."""

    searched = {p.config_key for p in sweep.search_space}
    owned = searched | set(TRIAL_OWNED_KEYS)
    clashes = [o for o, (key, _) in zip(fixed_overrides, override_pairs(fixed_overrides), strict=True) if key in owned]
    if clashes:
        raise ConfigError(
            f"trial overrides {clashes} set keys the sweep sets itself (searched or per trial); "
            "drop them, or change the search space with space.<name>.<field>=..."
        )


def sweep_trial_job(
    sweep,
    *,
    job,
    data: str,
    config_path: str | None = None,
    settings: Mapping[str, Any] | None = None,
    fixed_overrides: Sequence[str] = DEFAULT_TRIAL_OVERRIDES,
    mlflow_parent_run_id: str = "",
    mlflow_experiment: str = "",
) -> dict:
    """The trial's job as a dict (the backend's ``trial_job``: a PyTorchJob, a TrainJob for trainjob):
    ``job`` (the plan's JobPlan: image, resources, Secrets, node selector) running the trainer on the existing tokenized
    shards ``data`` (never re-tokenized), each trial in ``<volume>/sweeps/<experiment>/<trial name>``.

    A trial starts from the final training's config, so it tunes the model the train step trains:
    ``config_path`` (the plan's config.yaml: ``llmft train --config``), or, where no plan step wrote
    one (``llmft sweep create``), ``settings`` (dotted key -> value) on the command line. Then the
    keys a trial sets itself, the fixed trial settings and the searched ones (Katib's
    ``${trialParameters.x}``) replace theirs."""
    if not data:
        raise ConfigError(
            "data= is required: the tokenized shards on the PVC written by `llmft data tokenize` "
            "(e.g. data=/data/tokenized/<cache key>); trials never tokenize"
        )
    check_trial_overrides(sweep, fixed_overrides)
    trial: dict[str, Any] = {
        "data": data,
        "output_dir": f"{job.mount_path}/sweeps/{sweep.name}/{TRIAL_NAME_PLACEHOLDER}",
        "observe.run_name": TRIAL_NAME_PLACEHOLDER,
        **dict(override_pairs([*fixed_overrides, *trial_overrides(sweep)])),
    }
    if mlflow_experiment:
        trial["observe.mlflow_experiment"] = mlflow_experiment
    base = {k: v for k, v in (settings or {}).items() if k not in {*trial, *SETTINGS_NOT_CARRIED}}
    launch = TrainerLaunch(config_path, {**base, **trial})
    spec = build_job_spec(job, launch, name=job_name(sweep.name), namespace=sweep.namespace)
    if mlflow_parent_run_id:
        spec = dataclasses.replace(spec, env={**spec.env, PARENT_RUN_ENV: mlflow_parent_run_id})
    return trial_backend(job.backend).build_trial_job(job, spec, sweep.early_stopping)


def trial_backend(name: str) -> Backend:
    """The backend whose job a Katib trial of a ``training_backend=name`` run is: the registry's explicit trial
    policy (llmft/components/lib/jobs/backends.py ``Backend.katib_trials``); ConfigError for one without."""
    return backend_for(name).trials_backend()


def build_sweep_experiment(sweep, **job):
    """The ``V1beta1Experiment`` for ``sweep`` whose trials run :func:`sweep_trial_job` (``**job``)."""
    return build_experiment(sweep, sweep_trial_job(sweep, **job))


def check_servable_ranks(sweep, max_lora_rank: int) -> None:
    """Refuse a search space whose LoRA ranks the vLLM runtime (``--max-lora-rank``) would not serve."""

    for param in sweep.search_space:
        if param.config_key != "lora.r":
            continue
        ranks = [float(v) for v in param.values] if param.values else [float(param.max or 0)]
        if max(ranks) > max_lora_rank:
            raise ConfigError(
                f"the sweep searches lora.r up to {max(ranks):g} but serving_max_lora_rank={max_lora_rank}: "
                "vLLM would refuse the winner. Lower space.lora_r.values or raise serving_max_lora_rank (or serve the "
                "winner merged: serving_mode=merged)"
            )


SHADOWING_KEYS = {"schedule.warmup_ratio": "schedule.warmup_steps"}
"""searched key -> trainer key that, when > 0, takes precedence over it."""


def warn_shadowed(user_overrides: Sequence[str], best: Sequence[str]) -> None:
    """The train step passes the sweep's best after the plan's config, so the best win. Print a
    warning for a ``finetune_overrides`` setting a best value replaces, or one that would make a swept
    value ineffective (``schedule.warmup_steps`` > 0 overrides ``schedule.warmup_ratio``)."""
    user_keys = dict(override_pairs(user_overrides))
    for item, (key, _) in zip(best, override_pairs(best), strict=True):
        if key in user_keys:
            print(f"warning: finetune_overrides sets {key}={user_keys[key]}; the sweep's {item} replaces it")
        shadow = SHADOWING_KEYS.get(key)
        if shadow in user_keys and user_keys[shadow] not in ("0", "0.0"):
            print(
                f"warning: train_overrides sets {shadow}={user_keys[shadow]}, which takes precedence over the "
                f"swept {item}; drop it to train with the sweep's value"
            )


def run_sweep_step(plan, *, tokenized_dir: str, output_dir: str, cluster=None, poll_s: float = 30.0) -> dict:
    """The sweep component's logic (importable, testable): build, run and summarise the plan's sweep.

    Returns ``{"experiment", "best_overrides", "metrics"}``; raises ``ExperimentFailed`` when
    the sweep fails or no trial reports the objective."""
    sweep, trainer = plan.sweep, plan.trainer
    spec = apply_overrides(SweepSpec(name=sweep.experiment), list(sweep.settings))
    fixed = list(sweep.trial_overrides)
    if plan.registry.tracking_uri:  # the parameter wins over the Secret's key, as in the train step
        os.environ["MLFLOW_TRACKING_URI"] = plan.registry.tracking_uri
    os.makedirs(output_dir, exist_ok=True)
    experiment = plan.registry.experiment
    tags = sweep_parent_tags(plan)  # the sweep's run nests under the pipeline run's (lib/registry/lineage.py)
    if sweep.backend == "local":  # run_local_sweep opens the MLflow parent run itself
        plan.layout.use_hf_cache()  # its trials, as the train step's trainer, read a hub model from the volume's cache
        result = _run_local(spec, tokenized_dir, trainer.config_path, fixed, sweep.workdir, experiment, tags)
    else:
        with ParentRun(f"sweep-{spec.name}", experiment, params={"algorithm": spec.algorithm}, tags=tags) as parent:
            result = _run_katib(
                spec,
                cluster,
                sweep.timeout_s,
                poll_s,
                Path(output_dir),
                job=plan.job,
                data=tokenized_dir,
                config_path=trainer.config_path,
                fixed_overrides=fixed,
                mlflow_parent_run_id=parent.run_id or "",
                mlflow_experiment=parent.experiment if parent.run_id else experiment,
            )
            _log_parent_result(parent, result)
    Path(output_dir, "best.txt").write_text("\n".join(result["best_overrides"]) + "\n")
    print("best hyperparameters:\n  " + "\n  ".join(result["best_overrides"]), flush=True)
    warn_shadowed(trainer.user_overrides, result["best_overrides"])
    return result


def _run_local(spec, tokenized_dir, config_path, fixed, workdir, mlflow_experiment, tags=None) -> dict:
    # the final training's config, as the Katib trials; each trial's run is named after its output_dir
    args = [f"data={tokenized_dir}", "observe.run_name=", *fixed]
    result = local_sweep.run_local_sweep(
        spec,
        trials=spec.max_trials,
        trainer_args=args,
        workdir=workdir,
        mlflow_experiment=mlflow_experiment,
        mlflow_tags=tags,
        config_path=config_path,
        python=local_trainer_python(),  # a Katib trial's pod runs the trainer image
    )
    print(result.table(), flush=True)
    best = result.best
    if best is None:
        raise ExperimentFailed(f"local sweep {spec.name}: no trial reported {spec.objective_metric}\n{result.table()}")
    return {
        "experiment": spec.name,
        "best_overrides": best.overrides,
        "metrics": {
            f"best_{spec.objective_metric}": best.metrics[spec.objective_metric],
            "trials_succeeded": sum(t.status == "Succeeded" for t in result.trials),
            "trials_failed": sum(t.status != "Succeeded" for t in result.trials),
        },
    }


def _run_katib(spec, cluster, timeout_s, poll_s, output_dir, **job) -> dict:
    body = build_sweep_experiment(spec, **job).to_dict()
    body["metadata"].setdefault("labels", {}).update(job["job"].labels)  # the run-id label: cleanup finds it
    check_experiment(body)
    (output_dir / "experiment.yaml").write_text(to_yaml(body))
    cluster = cluster or cluster_module.Cluster(spec.namespace)
    check_trial_resources(cluster, trial_kind(body["spec"]["trialTemplate"]["trialSpec"]))  # before any trial runs
    namespace = spec.namespace or cluster.namespace
    owner = run_owner_reference(cluster) if namespace == cluster.namespace else None
    if owner:  # the run's Workflow owns the Experiment (and so, through Katib, its trials): cleanup.py
        body["metadata"]["ownerReferences"] = [owner]
    with delete_on_sigterm(cluster, GROUP, VERSION, PLURAL, spec.name, namespace=namespace):
        katib_status.submit(cluster, body, namespace=namespace)  # a retried task re-attaches to its Experiment
        print(f"Katib Experiment {namespace}/{spec.name}: waiting up to {timeout_s:.0f}s", flush=True)
        state = katib_status.wait(
            cluster,
            spec.name,
            namespace,
            timeout_s=timeout_s,
            poll_s=poll_s,
            on_update=lambda s: print(s.summary(), flush=True),
        )
    overrides = katib_status.best_overrides(
        cluster.get_custom_object(GROUP, VERSION, PLURAL, spec.name, namespace=namespace)
    )
    metrics = {f"best_{k}": v for k, v in state.best_metrics.items()}
    metrics.update({f"trials_{k}": v for k, v in state.trials.items() if k in ("succeeded", "failed", "total")})
    return {"experiment": spec.name, "best_overrides": overrides, "metrics": metrics}


def _log_parent_result(parent, result: dict) -> None:
    for key, value in result["metrics"].items():
        parent.log_metric(key, value)
    parent.log_params({f"best.{key}": value for key, value in override_pairs(result["best_overrides"])})
