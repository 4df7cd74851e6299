"""`llm_finetune_hpo_pipeline`: plan -> prepare -> tokenize -> sweep (Katib) -> train with the best
hyperparameters -> evaluate -> promote -> serving form -> register in MLflow -> deploy to KServe vLLM.

The same plan component, steps and platform settings as ``llm_finetune_pipeline``
(llmft/pipelines/llm_finetune.py builds both); its parameters add the plan component's ``sweep_*``
ones. The sweep step sits between tokenize and train: it creates a Katib Experiment whose trials
run the trainer as PyTorchJobs (the plan's image, resources and Secrets) on the shards the
tokenize step wrote (no trial tokenizes), each trial starting from the plan's config.yaml, waits for
it, and hands the optimal trial's ``key=value`` pairs to the train step, which passes them after
``--config <run_dir>/config.yaml``, so they win over ``learning_rate`` / ``lora_*`` and
``train_overrides``. With MLflow configured
the sweep is a parent run with one child run per trial.

``sweep_backend=local`` runs the trials with Optuna inside the sweep step's process instead
(``llmft pipeline run-local --hpo`` and CPU tests; refused on a cluster).
"""

# No `from __future__ import annotations`: KFP reads the real parameter annotations.
from llmft.components.lib.plan.steps import task_order
from llmft.pipelines.llm_finetune import SWEEP_RETRIES, SWEEP_TASK_TIMEOUT_S, build_pipeline  # noqa: F401
from llmft.pipelines.llm_finetune import compile_pipeline as compile_any

PIPELINE_NAME = "llm-finetune-hpo"
TASK_ORDER = task_order(hpo=True)
"""The ten tasks, in the order they run."""

HPO_LOCAL_DEFAULTS = {
    "sweep_backend": "local",
    "sweep_algorithm": "random",
    "sweep_max_trials": 3,
    "sweep_parallel_trials": 1,
    "sweep_max_failed_trials": 1,
    "sweep_overrides": "space.lora_r.values=4,8 space.lora_alpha.values=8,16",
    "sweep_trial_overrides": (
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


llm_finetune_hpo_pipeline = build_pipeline(hpo=True)
"""The HPO pipeline with the defaults of this environment."""


def compile_pipeline(output: str, *, defaults=None) -> str:
    """Compile ``llm_finetune_hpo_pipeline`` (``defaults`` replace parameter defaults) to ``output``."""

    return compile_any(output, hpo=True, defaults=defaults)
