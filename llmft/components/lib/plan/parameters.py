"""The pipeline parameters as one frozen, typed value: what the plan builder reads.

:class:`PipelineParameters` mirrors ``plan_run``'s signature (llmft/components/plan.py, which KFP
reads: its parameters' names, types and defaults are the pipelines' parameter list, and its
docstring's Args their descriptions). A test holds the two equal, field by field (name, type,
default, order): a parameter added to one and not the other fails it
(tests/pipeline/test_pipeline_parameters.py). Building one from a mapping refuses a missing or an
unknown name, naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmft.trainer.errors import ConfigError


@dataclass(frozen=True)
class PipelineParameters:
    """Every pipeline parameter, typed (their meaning: ``plan_run``'s Args)."""

    model: str = "Qwen/Qwen2.5-7B-Instruct"
    dataset: str = "tatsu-lab/alpaca"
    dataset_format: str = "auto"
    dataset_split: str = "train"
    dataset_config: str = ""
    dataset_columns: str = ""
    val_fraction: float = 0.05
    max_reject_fraction: float = 0.01
    max_length: int = 2048
    packing: bool = True
    method: str = "lora"
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.05
    lora_target_modules: str = "all-linear"
    learning_rate: float = 0.0002
    epochs: float = 1.0
    max_steps: int = 0
    seed: int = 42
    train_overrides: str = ""
    sweep_backend: str = "katib"
    sweep_algorithm: str = "tpe"
    sweep_max_trials: int = 12
    sweep_parallel_trials: int = 3
    sweep_max_failed_trials: int = 3
    sweep_overrides: str = ""
    sweep_trial_overrides: str = ""
    sweep_timeout_s: int = 3 * 24 * 3600
    training_backend: str = "kubeflow"
    training_runtime: str = "torch-distributed"
    num_workers: int = 1
    gpus_per_worker: int = 1
    worker_cpu: str = "8"
    worker_memory: str = "64Gi"
    gpu_node_selector: str = ""
    job_timeout_s: int = 24 * 3600
    trainer_image: str = ""
    pvc_name: str = "llmft-data"
    data_root: str = "/data"
    hf_token_secret: str = ""
    mlflow_secret: str = ""
    langfuse_secret: str = ""
    s3_secret: str = ""
    step_cpu: str = "1"
    step_memory: str = "2Gi"
    data_cpu: str = "4"
    data_memory: str = "16Gi"
    eval_cpu: str = "8"
    eval_memory: str = "64Gi"
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = "llm-finetune"
    mlflow_model_name: str = "llm-adapter"
    promote_margin: float = 0.01
    promote_metric: str = "perplexity"
    eval_tasks: str = "heldout"
    eval_questions: str = ""
    eval_max_questions: int = 16
    eval_guards: str = ""
    eval_num_fewshot: int = -1
    eval_limit: int = 500
    eval_batch_size: int = 8
    deploy: bool = True
    deploy_mode: str = "kserve"
    deploy_policy: str = "champion"
    serving_mode: str = "auto"
    serving_name: str = "llm-adapter"
    serving_namespace: str = ""
    serving_gpus: int = 1
    serving_cpu: str = "4"
    serving_memory: str = "32Gi"
    serving_runtime: str = ""
    max_lora_rank: int = 64
    serving_prompts: str = ""
    deploy_timeout_s: int = 1800

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> PipelineParameters:
        """The parameters from ``name -> value`` (``plan_run``'s inputs, or the pipeline's defaults with a
        command line's changes): every name present, none unknown."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ConfigError(f"pipeline parameter `{unknown[0]}` is unknown (known: {', '.join(names)})")
        missing = [name for name in names if name not in values]
        if missing:
            raise ConfigError(f"pipeline parameter `{missing[0]}` is missing from the plan step's inputs")
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """name -> value of every parameter, in declaration order (``plan.json``'s ``parameters``); taken
        from ``vars``, so a test that records attribute reads sees only the builder's own."""
        return dict(vars(self))
