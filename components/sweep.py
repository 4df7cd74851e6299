"""Step 3a of the HPO pipeline: sweep the training hyperparameters with Katib.

Thin: the logic is ``llmft.components.lib.sweep.run_sweep_step`` (Experiment built from katib/,
submitted through components.lib.cluster, waited for, best trial read back).
"""

# No `from __future__ import annotations`: KFP reads the real parameter annotations.
from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output
from llmft.components.images import KATIB_IMAGE


@dsl.component(base_image=KATIB_IMAGE, install_kfp_package=False)
def sweep_hyperparameters(
    tokenized: Input[Dataset],
    model: str,
    method: str,
    sweep_backend: str,
    algorithm: str,
    max_trials: int,
    parallel_trials: int,
    max_failed_trials: int,
    sweep_overrides: str,
    trial_overrides: str,
    train_overrides: str,
    max_lora_rank: int,
    num_workers: int,
    gpus_per_worker: int,
    pvc_name: str,
    data_root: str,
    run_id: str,
    mlflow_tracking_uri: str,
    mlflow_experiment: str,
    timeout_s: int,
    sweep: Output[Artifact],
    metrics: Output[Metrics],
) -> str:
    """Search the training hyperparameters on the tokenized shards; return the train step's overrides.

    ``sweep_backend=katib`` creates a Katib Experiment (trials are PyTorchJobs running
    ``torchrun -m llmft.trainer`` on the existing shards; objective: minimize ``eval_loss``),
    waits for it, and reads its optimal trial. ``local`` runs the same search space with
    Optuna, trials in sequence in this pod. ``sweep_overrides`` edits the search
    (``space.lora_r.values=8,16``); ``trial_overrides`` are fixed trainer settings of every
    trial (``max_steps=200 eval_every=25``). With MLflow configured the sweep is a parent run
    and every trial a child run.

    Outputs: ``sweep`` (experiment.yaml, best.txt, state.json), ``metrics`` (best eval loss,
    trial counts). Returns ``train_overrides`` followed by the best ``key=value`` pairs (the
    best win), ready for the train step's ``train_overrides``.
    """
    import json
    import os
    import shlex

    from llmft.components.lib.sweep import final_train_overrides, run_sweep_step

    result = run_sweep_step(
        tokenized_dir=tokenized.metadata["path"],
        model=model,
        method=method,
        backend=sweep_backend,
        sweep_overrides=[
            f"algorithm={algorithm}",
            f"max_trials={max_trials}",
            f"parallel_trials={parallel_trials}",
            f"max_failed_trials={max_failed_trials}",
            *shlex.split(sweep_overrides or ""),
        ],
        trial_overrides=shlex.split(trial_overrides or ""),
        max_lora_rank=max_lora_rank,
        num_workers=num_workers,
        gpus_per_worker=gpus_per_worker,
        pvc_name=pvc_name,
        data_root=data_root,
        run_id=run_id,
        mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment,
        timeout_s=timeout_s,
        output_dir=sweep.path,
    )
    sweep.metadata.update(
        {
            "experiment": result["experiment"],
            "backend": sweep_backend,
            "best_overrides": " ".join(result["best_overrides"]),
        }
    )
    for name, value in sorted(result["metrics"].items()):
        metrics.log_metric(name, value)
    with open(os.path.join(sweep.path, "state.json"), "w") as fh:
        json.dump(result, fh, indent=2, sort_keys=True, default=str)
    return final_train_overrides(train_overrides, result["best_overrides"])
