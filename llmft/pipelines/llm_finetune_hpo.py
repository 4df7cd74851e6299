"""`llm_finetune_hpo_pipeline`: plan -> prepare -> tokenize -> sweep (Katib) -> train with the best
hyperparameters -> evaluate -> promote -> serving form -> register in MLflow -> deploy to KServe vLLM.

The same plan component, steps and platform settings as ``llm_finetune_pipeline``
(llmft/pipelines/llm_finetune.py builds both); its parameters add the ``hpo_*`` ones. The sweep step sits
between tokenize and train: it creates a Katib Experiment whose trials run the trainer as the plan's
training job (image, resources and Secrets) on the shards the tokenize step wrote (no trial tokenizes),
each trial starting from the plan's config.yaml, waits for it, and hands the optimal trial's ``key=value``
pairs to the train step, which passes them after ``--config <run_dir>/config.yaml``, so they win over
``finetune_learning_rate`` / ``finetune_lora_*`` and ``finetune_overrides``. With MLflow configured the
sweep is a parent run with one child run per trial.

``hpo_backend=local`` (a kfp.local setting) runs the trials with Optuna inside the sweep step's process instead
(``llmft pipeline run-local --hpo`` and CPU tests; refused on a cluster).
"""

# No `from __future__ import annotations`: KFP reads the real parameter annotations.
from llmft.components.lib.plan.forms import Form
from llmft.components.lib.plan.steps import task_order
from llmft.pipelines.llm_finetune import SWEEP_RETRIES, SWEEP_TASK_TIMEOUT_S, build_pipeline  # noqa: F401
from llmft.pipelines.llm_finetune import compile_pipeline as compile_any

PIPELINE_NAME = Form(hpo=True).pipeline_name
TASK_ORDER = task_order(hpo=True)
"""The ten tasks, in the order they run."""

HPO_LOCAL_DEFAULTS = {
    "hpo_backend": "local",
    "hpo_algorithm": "random",
    "hpo_max_trials": 3,
    "hpo_parallel_trials": 1,
    "hpo_max_failed_trials": 1,
    "hpo_overrides": "space.lora_r.values=4,8 space.lora_alpha.values=8,16",
    "hpo_trial_overrides": (
        "max_steps=8 eval_every=4 log_every=4 batch.global_sequences=4 eval.max_sequences=16 "
        "observe.progress_bar=false observe.tensorboard=false"
    ),
    "finetune_save_every": 8,
    "finetune_eval_every": 8,
    # LOCAL_DEFAULTS' finetune_overrides without schedule.warmup_steps, which would shadow the swept warmup_ratio
    "finetune_overrides": "log_every=4 keep_last=3 observe.progress_bar=false",
}
"""What ``llmft pipeline run-local --hpo`` puts over pipelines.defaults.LOCAL_DEFAULTS: a 3-trial
Optuna sweep in the step's process, ranks within the local serving_max_lora_rank (8)."""


llm_finetune_hpo_pipeline = build_pipeline(hpo=True)
"""The HPO pipeline with the defaults of this environment."""


def compile_pipeline(output: str, *, minimal: bool = False, defaults=None) -> str:
    """Compile ``llm_finetune_hpo_pipeline`` (``defaults`` replace parameter defaults) to ``output``."""

    return compile_any(output, hpo=True, minimal=minimal, defaults=defaults)
