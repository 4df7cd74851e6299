"""The values a run's settings choose from, and the promote step's decision: shared by the plan step (which checks
a parameter against them), the pipeline builder and the steps that branch on them. No module of
llmft/components/lib is imported here (the contracts layer).
"""

from __future__ import annotations

DEPLOY_MODES = ("kserve", "local", "vllm")
"""kserve: an InferenceService on the cluster; local: a transformers generation check (kfp.local); vllm: a real
vLLM OpenAI server on this machine with the manifest's arguments and the smoke test (kfp.local,
``make serving-venv``)."""
SERVING_MODES = ("auto", "lora", "merged")
"""auto: the adapter as a vLLM LoRA module when vLLM can serve it, else merged into its base (the reason
logged); lora: LoRA only (an adapter vLLM refuses fails the run); merged: always the merged model
(llmft/components/lib/serving/serving_form.py)."""
CLUSTER_DEPLOY_MODES = ("kserve",)
"""The deploy modes a cluster's pipeline image runs (the others need this machine's torch or vLLM: kfp.local)."""
SWEEP_BACKENDS = ("katib", "local")
CLUSTER_SWEEP_BACKENDS = ("katib",)
"""The sweep backends that create cluster objects (a Katib Experiment): refused under kfp.local."""
PIPELINE_OWNED_KEYS = ("model.name_or_path", "data", "output_dir", "method", "resume")
"""Trainer keys the plan sets itself; ``finetune_overrides`` may not change them."""
TRAIN_TASK_TIMEOUT_S = 3 * 24 * 3600
"""kfp.kubernetes.set_timeout of the train task: the job's own deadline (``training_timeout_s``) must end first."""
SWEEP_TASK_TIMEOUT_S = 4 * 24 * 3600
"""kfp.kubernetes.set_timeout of the sweep task: longer than its own wait (``hpo_timeout_s``)."""
DEPLOY_POLICIES = ("champion", "always")
"""champion: deploy only a version that became (or stayed) the registry's champion; always: deploy it anyway."""

PROMOTED, NOT_PROMOTED = "promoted", "not promoted"
"""The promote step's decision (its ``decision`` output): the steps after it run under one of the two
(lib/plan/steps.py ``Step.branch``, the pipeline's ``dsl.If``)."""

NO_MLFLOW_REASON = (
    "no MLflow server configured (mlflow_tracking_uri is empty and mlflow_secret names no Secret with the key "
    "MLFLOW_TRACKING_URI); set either to track and register"
)
"""Why a run without MLflow registers nothing (the register step's registration.json, the summary)."""
