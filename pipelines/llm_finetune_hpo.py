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
from llmft.components.lib.params import DATA_MOUNT
from llmft.components.lib.sweep import DEFAULT_TRIAL_OVERRIDES
from llmft.components.sweep import sweep_hyperparameters
from llmft.pipelines.llm_finetune import (
    add_data_steps,
    add_release_steps,
    add_train_step,
    apply_platform,
    call_component,
)

PIPELINE_NAME = "llm-finetune-hpo"
TASK_ORDER = (
    "prepare-dataset",
    "tokenize-dataset",
    "sweep-hyperparameters",
    "train-model",
    "evaluate-perplexity",
    "promote-best-checkpoint",
    "register-model",
    "deploy-adapter",
)
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
    "trial_overrides": (
        "max_steps=8 eval_every=4 log_every=4 batch.global_sequences=4 eval.max_sequences=16 "
        "observe.progress_bar=false observe.tensorboard=false"
    ),
    # LOCAL_DEFAULTS' train_overrides without schedule.warmup_steps, which would shadow the swept warmup_ratio
    "train_overrides": (
        "save_every=8 eval_every=8 log_every=4 keep_last=3 batch.global_sequences=4 observe.progress_bar=false"
    ),
}
"""What ``llmft pipeline run-local --hpo`` puts over pipelines.defaults.LOCAL_DEFAULTS: a 3-trial
Optuna sweep in the step's process, ranks within the local max_lora_rank (8)."""


@dsl.pipeline(
    name=PIPELINE_NAME,
    description="Sweep the fine-tuning hyperparameters with Katib, then fine-tune, evaluate, register "
    "and serve the best adapter",
)
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
    params = {**locals(), "run_id": dsl.PIPELINE_JOB_ID_PLACEHOLDER}
    _prepare, tokenize = add_data_steps(params)

    sweep = call_component(
        sweep_hyperparameters,
        params,
        tokenized=tokenize.outputs["tokenized"],
        algorithm=sweep_algorithm,
        max_trials=sweep_max_trials,
        parallel_trials=sweep_parallel_trials,
        max_failed_trials=sweep_max_failed_trials,
        timeout_s=sweep_timeout_s,
    )
    # The same Secrets as the train step: its trials train (HF token, MLflow, Langfuse).
    apply_platform(sweep.set_display_name("sweep hyperparameters (Katib)"), "train-model", pvc_name)
    sweep.set_retry(num_retries=SWEEP_RETRIES, backoff_duration="60s", backoff_factor=2.0)
    kubernetes.set_timeout(sweep, SWEEP_TASK_TIMEOUT_S)

    # The sweep's best key=value overrides come after train_overrides, so they win.
    train = add_train_step(
        params, tokenize, display_name="train with the best hyperparameters", train_overrides=sweep.outputs["Output"]
    )
    add_release_steps(params, tokenize, train)


def compile_pipeline(output: str) -> str:
    """Compile ``llm_finetune_hpo_pipeline`` to ``output`` (YAML) and return the path."""
    from kfp import compiler

    compiler.Compiler().compile(llm_finetune_hpo_pipeline, package_path=output)
    return output
