"""`llm_finetune_hpo_pipeline`: prepare -> tokenize -> sweep (Katib) -> train with the best
hyperparameters -> evaluate -> promote -> register in MLflow -> deploy to KServe vLLM.

The same components and platform settings as ``llm_finetune_pipeline`` (pipelines/llm_finetune.py),
with the sweep step between tokenize and train: it creates a Katib Experiment whose trials
run the trainer as PyTorchJobs on the shards the tokenize step wrote (no trial tokenizes),
waits for it, and hands the optimal trial's ``key=value`` overrides to the train step, where
they come after ``train_overrides`` and so win over the ``learning_rate`` / ``lora_*``
parameters. With MLflow configured the sweep is a parent run with one child run per trial.

``sweep_backend=local`` runs the trials with Optuna inside the sweep step's pod instead
(``llmft pipeline run-local --hpo`` and CPU tests).
"""

# No `from __future__ import annotations`: KFP reads the real parameter annotations.
from kfp import dsl, kubernetes

from components.deploy import deploy_adapter
from components.evaluate import evaluate_perplexity
from components.lib.params import DATA_MOUNT
from components.lib.sweep import DEFAULT_TRIAL_OVERRIDES
from components.prepare_dataset import prepare_dataset
from components.promote import promote_best_checkpoint
from components.register import register_model
from components.sweep import sweep_hyperparameters
from components.tokenize_dataset import tokenize_dataset
from components.train import train_model
from pipelines.llm_finetune import TRAIN_RETRIES, TRAIN_TASK_TIMEOUT_S, _platform

PIPELINE_NAME = "llm-finetune-hpo"
TASK_ORDER = ("prepare-dataset", "tokenize-dataset", "sweep-hyperparameters", "train-model", "evaluate-perplexity",
              "promote-best-checkpoint", "register-model", "deploy-adapter")
"""The eight tasks, in the order they run."""
SWEEP_TASK_TIMEOUT_S = 4 * 24 * 3600
"""kfp.kubernetes.set_timeout of the sweep task (longer than its own wait, sweep_timeout_s)."""
SWEEP_RETRIES = 2
"""Retries of the sweep task; a retry re-attaches to the same Experiment (its name derives from the run id)."""

HPO_LOCAL_DEFAULTS = {
    "sweep_backend": "local",
    "sweep_algorithm": "random",
    "sweep_max_trials": 3,
    "sweep_parallel_trials": 1,
    "sweep_max_failed_trials": 1,
    "sweep_overrides": "space.lora_r.values=4,8 space.lora_alpha.values=8,16",
    "trial_overrides": ("max_steps=8 eval_every=4 log_every=4 batch.global_sequences=4 eval.max_sequences=16 "
                        "observe.progress_bar=false observe.tensorboard=false"),
    # LOCAL_DEFAULTS' train_overrides without schedule.warmup_steps, which would shadow the swept warmup_ratio
    "train_overrides": ("save_every=8 eval_every=8 log_every=4 keep_last=3 batch.global_sequences=4 "
                        "observe.progress_bar=false"),
}
"""What ``llmft pipeline run-local --hpo`` puts over pipelines.defaults.LOCAL_DEFAULTS: a 3-trial
Optuna sweep in the step's process, ranks within the local max_lora_rank (8)."""


@dsl.pipeline(name=PIPELINE_NAME,
              description="Sweep the fine-tuning hyperparameters with Katib, then fine-tune, evaluate, register "
                          "and serve the best adapter")
def llm_finetune_hpo_pipeline(
    model: str = "Qwen/Qwen2.5-7B-Instruct",
    dataset: str = "tatsu-lab/alpaca",
    dataset_format: str = "auto",
    dataset_split: str = "train",
    val_fraction: float = 0.05,
    max_reject_fraction: float = 0.01,
    max_length: int = 2048,
    packing: bool = True,
    method: str = "lora",
    lora_r: int = 16,
    lora_alpha: float = 32.0,
    lora_dropout: float = 0.05,
    lora_target_modules: str = "all-linear",
    learning_rate: float = 2e-4,
    epochs: float = 1.0,
    max_steps: int = 0,
    seed: int = 42,
    train_overrides: str = "",
    sweep_backend: str = "katib",
    sweep_algorithm: str = "tpe",
    sweep_max_trials: int = 12,
    sweep_parallel_trials: int = 3,
    sweep_max_failed_trials: int = 3,
    sweep_overrides: str = "",
    trial_overrides: str = " ".join(DEFAULT_TRIAL_OVERRIDES),
    sweep_timeout_s: int = 3 * 24 * 3600,
    training_backend: str = "kubeflow",
    num_workers: int = 1,
    gpus_per_worker: int = 1,
    job_timeout_s: int = 2 * 24 * 3600,
    pvc_name: str = "llmft-data",
    data_root: str = DATA_MOUNT,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "llm-finetune",
    mlflow_model_name: str = "llm-adapter",
    promote_margin: float = 0.01,
    deploy: bool = True,
    deploy_mode: str = "kserve",
    serving_name: str = "llm-adapter",
    serving_namespace: str = "",
    serving_gpus: int = 1,
    max_lora_rank: int = 64,
    deploy_timeout_s: int = 1800,
):
    """Parameters: those of llm_finetune_pipeline (lora_* and learning_rate are the fallbacks the
    sweep's best values override), plus the sweep's:

    sweep_backend: katib (a Katib Experiment of PyTorchJob trials) | local (Optuna in the step).
    sweep_algorithm: random | tpe | grid | bayesianoptimization. sweep_max_trials,
    sweep_parallel_trials, sweep_max_failed_trials: Katib's trial counts. sweep_overrides:
    "key=value ..." for the sweep (space.lora_r.values=8,16, early_stopping=false, ...).
    trial_overrides: fixed trainer settings of every trial (short runs with several evals).
    sweep_timeout_s: how long the step waits for the Experiment.
    """
    run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
    prepare = prepare_dataset(
        dataset=dataset, dataset_format=dataset_format, dataset_split=dataset_split, val_fraction=val_fraction,
        max_reject_fraction=max_reject_fraction, seed=seed, data_root=data_root, run_id=run_id, model=model,
        method=method, lora_r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
        lora_target_modules=lora_target_modules, learning_rate=learning_rate, epochs=epochs, max_steps=max_steps,
        train_overrides=train_overrides, training_backend=training_backend, num_workers=num_workers,
        gpus_per_worker=gpus_per_worker, max_length=max_length, promote_margin=promote_margin, pvc_name=pvc_name,
        mlflow_model_name=mlflow_model_name, deploy=deploy, deploy_mode=deploy_mode, serving_name=serving_name,
        max_lora_rank=max_lora_rank)
    _platform(prepare.set_display_name("prepare dataset"), "prepare-dataset", pvc_name)

    tokenize = tokenize_dataset(prepared=prepare.outputs["prepared"], model=model, max_length=max_length,
                                packing=packing, data_root=data_root)
    _platform(tokenize.set_display_name("tokenize to PVC"), "tokenize-dataset", pvc_name)

    sweep = sweep_hyperparameters(
        tokenized=tokenize.outputs["tokenized"], model=model, method=method, sweep_backend=sweep_backend,
        algorithm=sweep_algorithm, max_trials=sweep_max_trials, parallel_trials=sweep_parallel_trials,
        max_failed_trials=sweep_max_failed_trials, sweep_overrides=sweep_overrides, trial_overrides=trial_overrides,
        train_overrides=train_overrides, max_lora_rank=max_lora_rank, num_workers=num_workers,
        gpus_per_worker=gpus_per_worker, pvc_name=pvc_name, data_root=data_root, run_id=run_id,
        mlflow_tracking_uri=mlflow_tracking_uri, mlflow_experiment=mlflow_experiment, timeout_s=sweep_timeout_s)
    # The same Secrets as the train step: its trials train (HF token, MLflow, Langfuse).
    _platform(sweep.set_display_name("sweep hyperparameters (Katib)"), "train-model", pvc_name)
    sweep.set_retry(num_retries=SWEEP_RETRIES, backoff_duration="60s", backoff_factor=2.0)
    kubernetes.set_timeout(sweep, SWEEP_TASK_TIMEOUT_S)

    train = train_model(
        tokenized=tokenize.outputs["tokenized"], model=model, method=method, lora_r=lora_r, lora_alpha=lora_alpha,
        lora_dropout=lora_dropout, lora_target_modules=lora_target_modules, learning_rate=learning_rate,
        epochs=epochs, max_steps=max_steps, seed=seed, train_overrides=sweep.outputs["Output"],
        training_backend=training_backend, num_workers=num_workers, gpus_per_worker=gpus_per_worker,
        pvc_name=pvc_name, data_root=data_root, run_id=run_id, mlflow_tracking_uri=mlflow_tracking_uri,
        mlflow_experiment=mlflow_experiment, job_timeout_s=job_timeout_s)
    _platform(train.set_display_name("train with the best hyperparameters"), "train-model", pvc_name)
    train.set_retry(num_retries=TRAIN_RETRIES, backoff_duration="60s", backoff_factor=2.0)
    kubernetes.set_timeout(train, TRAIN_TASK_TIMEOUT_S)

    evaluate = evaluate_perplexity(tokenized=tokenize.outputs["tokenized"], run=train.outputs["run"], model=model,
                                   data_root=data_root)
    _platform(evaluate.set_display_name("evaluate perplexity"), "evaluate-perplexity", pvc_name)

    promote = promote_best_checkpoint(evaluation=evaluate.outputs["evaluation"], promote_margin=promote_margin,
                                      data_root=data_root, mlflow_model_name=mlflow_model_name, run_id=run_id)
    _platform(promote.set_display_name("promote best checkpoint"), "promote-best-checkpoint", pvc_name)

    register = register_model(
        promoted=promote.outputs["promoted"], evaluation=evaluate.outputs["evaluation"], run=train.outputs["run"],
        tokenized=tokenize.outputs["tokenized"], model=model, dataset=dataset,
        mlflow_tracking_uri=mlflow_tracking_uri, mlflow_experiment=mlflow_experiment,
        mlflow_model_name=mlflow_model_name, run_id=run_id, task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER)
    _platform(register.set_display_name("register in MLflow"), "register-model", pvc_name)
    register.set_retry(num_retries=2, backoff_duration="30s")

    deploy_task = deploy_adapter(
        promoted=promote.outputs["promoted"], registration=register.outputs["registration"], model=model,
        deploy=deploy, deploy_mode=deploy_mode, serving_name=serving_name, serving_namespace=serving_namespace,
        serving_gpus=serving_gpus, max_lora_rank=max_lora_rank, pvc_name=pvc_name, data_root=data_root,
        deploy_timeout_s=deploy_timeout_s)
    _platform(deploy_task.set_display_name("deploy to KServe vLLM"), "deploy-adapter", pvc_name)


def compile_pipeline(output: str) -> str:
    """Compile ``llm_finetune_hpo_pipeline`` to ``output`` (YAML) and return the path."""
    from kfp import compiler

    compiler.Compiler().compile(llm_finetune_hpo_pipeline, package_path=output)
    return output
