"""The logic of the sweep step: katib/ composed with the PyTorchJob builder and the cluster module.

katib/ is a leaf package (it never builds the PyTorchJob nor talks to a cluster itself), so
the composition lives here: :func:`sweep_trial_job` renders the trainer's PyTorchJob with
``${trialParameters.x}`` placeholders (components.lib.pytorchjob, the train step's builder),
:func:`build_sweep_experiment` wraps it in the Katib Experiment, and :func:`run_sweep_step`
(the ``sweep_hyperparameters`` component's body, components/sweep.py) creates it through
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
import re
from collections.abc import Sequence

SWEEP_BACKENDS = ("katib", "local")
PARENT_RUN_ENV = "LLMFT_MLFLOW_PARENT_RUN_ID"  # = katib.tracking.PARENT_RUN_ENV (what the trainer reads)
DEFAULT_TRIAL_OVERRIDES = ("max_steps=200", "eval_every=25", "save_every=0", "eval.max_sequences=512")
"""Fixed trainer settings of every trial: short runs, several evals (medianstop needs start_step of them)."""
TRIAL_OWNED_KEYS = ("model.name_or_path", "data", "output_dir", "method", "resume", "observe.run_name")
"""Keys each trial sets itself (the searched keys come from the sweep spec)."""


def experiment_name(run_id: str) -> str:
    """A Katib-valid Experiment name (<= 40 chars), stable for a pipeline run so a retry finds it."""
    cleaned = re.sub(r"[^a-z0-9]", "", run_id.lower())[:12]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
    return f"llmft-sweep-{cleaned}-{digest}" if cleaned else f"llmft-sweep-{digest}"


def sweep_trial_job(
    sweep,
    *,
    model: str,
    data: str,
    pvc_name: str,
    num_workers: int = 1,
    gpus_per_worker: int = 1,
    method: str = "lora",
    fixed_overrides: Sequence[str] = DEFAULT_TRIAL_OVERRIDES,
    data_root: str | None = None,
    mlflow_parent_run_id: str = "",
    mlflow_experiment: str = "",
    mlflow_tracking_uri: str = "",
    image: str | None = None,
) -> dict:
    """The trial's PyTorchJob as a dict: the trainer on the existing tokenized shards ``data``
    (never re-tokenized), each trial in ``<data_root>/sweeps/<experiment>/<trial name>``."""
    from llmft.components.lib.params import DATA_MOUNT
    from llmft.components.lib.pytorchjob import trial_pytorchjob_dict
    from llmft.components.lib.train_job import build_train_job_spec
    from llmft.katib.experiment import TRIAL_NAME_PLACEHOLDER, trial_overrides
    from llmft.trainer.errors import ConfigError

    if not data:
        raise ConfigError(
            "data= is required: the tokenized shards on the PVC written by `llmft data tokenize` "
            "(e.g. data=/data/tokenized/<cache key>); trials never tokenize"
        )
    searched = {p.config_key for p in sweep.search_space}
    clashes = [o for o in fixed_overrides if o.split("=", 1)[0] in searched | set(TRIAL_OWNED_KEYS)]
    if clashes:
        raise ConfigError(
            f"trial overrides {clashes} set keys the sweep sets itself (searched or per trial); "
            "drop them, or change the search space with space.<name>.<field>=..."
        )
    root = data_root or DATA_MOUNT
    overrides = [
        f"model.name_or_path={model}",
        f"data={data}",
        f"method={method}",
        f"output_dir={root}/sweeps/{sweep.name}/{TRIAL_NAME_PLACEHOLDER}",
        "resume=auto",
        f"observe.run_name={TRIAL_NAME_PLACEHOLDER}",
        *fixed_overrides,
        *trial_overrides(sweep),
    ]
    if mlflow_experiment:
        overrides.append(f"observe.mlflow_experiment={mlflow_experiment}")
    spec = build_train_job_spec(
        overrides,
        run_id=sweep.name,
        num_workers=num_workers,
        gpus_per_worker=gpus_per_worker,
        pvc_name=pvc_name,
        namespace=sweep.namespace,
        mlflow_tracking_uri=mlflow_tracking_uri,
    )
    changes: dict = {}
    if mlflow_parent_run_id:
        changes["env"] = {**spec.env, PARENT_RUN_ENV: mlflow_parent_run_id}
    if image:
        changes["image"] = image
    return trial_pytorchjob_dict(dataclasses.replace(spec, **changes))


def build_sweep_experiment(sweep, **job):
    """The ``V1beta1Experiment`` for ``sweep`` whose trials run :func:`sweep_trial_job` (``**job``)."""
    from llmft.katib.experiment import build_experiment

    return build_experiment(sweep, sweep_trial_job(sweep, **job))


def check_servable_ranks(sweep, max_lora_rank: int) -> None:
    """Refuse a search space whose LoRA ranks the vLLM runtime (``--max-lora-rank``) would not serve."""
    from llmft.trainer.errors import ConfigError

    for param in sweep.search_space:
        if param.config_key != "lora.r":
            continue
        ranks = [float(v) for v in param.values] if param.values else [float(param.max or 0)]
        if max(ranks) > max_lora_rank:
            raise ConfigError(
                f"the sweep searches lora.r up to {max(ranks):g} but max_lora_rank={max_lora_rank}: "
                "vLLM would refuse the winner. Lower space.lora_r.values or raise max_lora_rank"
            )


SHADOWING_KEYS = {"schedule.warmup_ratio": "schedule.warmup_steps"}
"""searched key -> trainer key that, when > 0, takes precedence over it."""


def final_train_overrides(train_overrides: str, best: list[str]) -> str:
    """The train step's ``train_overrides``: the user's, then the sweep's best (which win).

    Prints a warning for a user setting the sweep's value replaces, or one that would make a
    swept value ineffective (``schedule.warmup_steps`` > 0 overrides ``schedule.warmup_ratio``)."""
    import shlex

    user = shlex.split(train_overrides or "")
    user_keys = {item.split("=", 1)[0]: item.split("=", 1)[-1] for item in user}
    for item in best:
        key = item.split("=", 1)[0]
        if key in user_keys:
            print(f"warning: train_overrides sets {key}={user_keys[key]}; the sweep's {item} replaces it")
        shadow = SHADOWING_KEYS.get(key)
        if shadow in user_keys and user_keys[shadow] not in ("0", "0.0"):
            print(
                f"warning: train_overrides sets {shadow}={user_keys[shadow]}, which takes precedence over the "
                f"swept {item}; drop it to train with the sweep's value"
            )
    return shlex.join([*user, *best])


def run_sweep_step(
    *,
    tokenized_dir: str,
    model: str,
    method: str,
    backend: str,
    sweep_overrides: list[str],
    trial_overrides: list[str],
    max_lora_rank: int,
    num_workers: int,
    gpus_per_worker: int,
    pvc_name: str,
    data_root: str,
    run_id: str,
    mlflow_tracking_uri: str,
    mlflow_experiment: str,
    timeout_s: float,
    output_dir: str,
    cluster=None,
    poll_s: float = 30.0,
) -> dict:
    """The component's logic (importable, testable): build, run and summarise one sweep.

    Returns ``{"experiment", "best_overrides", "metrics"}``; raises ``ExperimentFailed`` when
    the sweep fails or no trial reports the objective."""
    import os
    from pathlib import Path

    from llmft.katib.experiment import SweepSpec, apply_overrides
    from llmft.trainer.errors import ConfigError

    if backend not in SWEEP_BACKENDS:
        raise ConfigError(f"sweep_backend={backend!r}: use one of {', '.join(SWEEP_BACKENDS)}")
    spec = apply_overrides(SweepSpec(name=experiment_name(run_id)), sweep_overrides)
    check_servable_ranks(spec, max_lora_rank)
    fixed = trial_overrides or list(DEFAULT_TRIAL_OVERRIDES)
    if mlflow_tracking_uri:  # the parameter wins over the Secret's key, as in the train step
        os.environ["MLFLOW_TRACKING_URI"] = mlflow_tracking_uri
    os.makedirs(output_dir, exist_ok=True)
    if backend == "local":  # run_local_sweep opens the MLflow parent run itself
        result = _run_local(
            spec, tokenized_dir, model, method, fixed, f"{data_root}/sweeps/{spec.name}", mlflow_experiment
        )
    else:
        from llmft.katib.tracking import ParentRun

        with ParentRun(f"sweep-{spec.name}", mlflow_experiment, params={"algorithm": spec.algorithm}) as parent:
            result = _run_katib(
                spec,
                cluster,
                timeout_s,
                poll_s,
                Path(output_dir),
                model=model,
                data=tokenized_dir,
                pvc_name=pvc_name,
                num_workers=num_workers,
                gpus_per_worker=gpus_per_worker,
                method=method,
                fixed_overrides=fixed,
                data_root=data_root,
                mlflow_parent_run_id=parent.run_id or "",
                mlflow_experiment=parent.experiment if parent.run_id else mlflow_experiment,
                mlflow_tracking_uri=mlflow_tracking_uri,
            )
            _log_parent_result(parent, result)
    Path(output_dir, "best.txt").write_text("\n".join(result["best_overrides"]) + "\n")
    print("best hyperparameters:\n  " + "\n  ".join(result["best_overrides"]), flush=True)
    return result


def _run_local(spec, tokenized_dir, model, method, fixed, workdir, mlflow_experiment) -> dict:
    from llmft.katib.errors import ExperimentFailed
    from llmft.katib.local_sweep import run_local_sweep

    args = [f"model.name_or_path={model}", f"data={tokenized_dir}", f"method={method}", *fixed]
    result = run_local_sweep(
        spec, trials=spec.max_trials, trainer_args=args, workdir=workdir, mlflow_experiment=mlflow_experiment
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
    from llmft.components.lib.cluster import Cluster
    from llmft.katib import status as katib_status
    from llmft.katib.experiment import GROUP, PLURAL, VERSION, to_yaml
    from llmft.katib.webhook_rules import check_experiment

    body = build_sweep_experiment(spec, **job).to_dict()
    check_experiment(body)
    (output_dir / "experiment.yaml").write_text(to_yaml(body))
    cluster = cluster or Cluster(spec.namespace)
    namespace = spec.namespace or cluster.namespace
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
    parent.log_params({f"best.{o.split('=', 1)[0]}": o.split("=", 1)[1] for o in result["best_overrides"]})
