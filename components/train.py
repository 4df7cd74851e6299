"""Step 3: fine-tune: a PyTorchJob on the cluster (backend kubeflow) or torchrun here (local)."""

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output
from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def train_model(
    tokenized: Input[Dataset],
    model: str,
    method: str,
    lora_r: int,
    lora_alpha: float,
    lora_dropout: float,
    lora_target_modules: str,
    learning_rate: float,
    epochs: float,
    max_steps: int,
    seed: int,
    train_overrides: str,
    training_backend: str,
    num_workers: int,
    gpus_per_worker: int,
    pvc_name: str,
    data_root: str,
    run_id: str,
    mlflow_tracking_uri: str,
    mlflow_experiment: str,
    job_timeout_s: int,
    run: Output[Model],
    metrics: Output[Metrics],
):
    """Run the project's trainer on the tokenized shards and output the run directory.

    ``training_backend=kubeflow`` builds a PyTorchJob (Master + Workers, ``torchrun -m llmft.trainer``
    with the same ``key=value`` overrides, restart policy ExitCode, the data PVC and the
    credential Secrets), submits it through the Training Operator, waits for its conditions
    while streaming the master's logs, and on failure fails with the job's last log lines.
    ``training_backend=local`` runs the same trainer with torchrun as subprocesses of this step.

    The run directory ``<data_root>/runs/<run_id>`` is stable across retries of this task, and
    the trainer resumes from its newest complete checkpoint (``resume=auto``).

    Outputs: ``run`` (training_manifest.json; metadata ``path`` = the run directory) and
    ``metrics`` (final and best eval loss / perplexity, tokens, wall time).
    """
    import json
    import os

    from llmft.components.lib.params import DataLayout, TrainingParams, trainer_overrides

    layout = DataLayout(data_root)
    layout.use_hf_cache()
    run_dir = layout.run_dir(run_id)
    params = TrainingParams(
        model=model,
        method=method,
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        lora_target_modules=lora_target_modules,
        learning_rate=learning_rate,
        epochs=epochs,
        max_steps=max_steps,
        seed=seed,
        extra_overrides=train_overrides,
    )
    overrides = trainer_overrides(params, data_dir=tokenized.metadata["path"], output_dir=run_dir)
    overrides.append(f"observe.run_name=pipeline-{run_id}")
    if mlflow_experiment:
        overrides.append(f"observe.mlflow_experiment={mlflow_experiment}")

    if training_backend == "local":
        from llmft.components.lib.local_train import run_local_training

        os.makedirs(run_dir, exist_ok=True)
        env = {"MLFLOW_TRACKING_URI": mlflow_tracking_uri} if mlflow_tracking_uri else {}
        run_local_training(
            overrides,
            nproc=max(1, num_workers),
            log_path=os.path.join(run_dir, "train.log"),
            env=env,
            timeout_s=job_timeout_s,
        )
    else:
        from llmft.components.lib.train_job import run_on_cluster

        run_on_cluster(
            overrides,
            run_id=run_id,
            num_workers=num_workers,
            gpus_per_worker=gpus_per_worker,
            pvc_name=pvc_name,
            timeout_s=job_timeout_s,
            mlflow_tracking_uri=mlflow_tracking_uri,
        )

    from llmft.components.lib.train_job import read_training_manifest, training_metrics

    manifest = read_training_manifest(run_dir)
    os.makedirs(run.path, exist_ok=True)
    with open(os.path.join(run.path, "training_manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True, default=str)
    run.metadata.update({"path": run_dir, "base_model": model, "method": method, "backend": training_backend})
    for name, value in sorted(training_metrics(manifest).items()):
        metrics.log_metric(name, value)
    print(f"training finished: run directory {run_dir}")
