"""The pipeline parameters: ONE declaration each, and everything derived from it.

Each field of :class:`PipelineParameters` declares one pipeline parameter: its name, type and default
(the field) and, in ``_p(...)``, its description (the KFP UI's), which forms of the pipeline offer it
(:class:`Form`) and the older names llmft still accepts for it. Derived from these declarations, never
written again:

* the KFP signature and docstring of every pipeline form (llmft/pipelines/llm_finetune.py
  ``build_pipeline``: KFP reads ``inspect.signature`` and the docstring's Args);
* the plan component's signature (llmft/components/plan.py ``plan_run``: KFP ships a component's source
  into its container, so it is generated code; ``make pipeline-parameters`` writes it and a test fails
  while it is stale);
* the typed value the plan builder reads (this class: mypy checks every ``p.lora_r``);
* the defaults (:func:`parameter_defaults`), which forms offer it and the older names' renaming
  (llmft/components/lib/plan/forms.py), ``key=value`` typing of the CLI, and docs/pipeline-parameters.md
  (generated, held fresh by a test).

A parameter that sets a trainer setting names it on the trainer's field (llmft/trainer/config.py,
``Setting(..., pipeline=<parameter name>)``); tests/pipeline/test_pipeline_parameters.py holds its default
to the trainer field's.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from llmft.components import images
from llmft.trainer.errors import ConfigError

Offer = Literal["run", "compile", "local"]
"""run: a run parameter of every form that has it; compile: fixed when the pipeline is compiled (the compiled
YAML applies it to the KFP tasks themselves), never a field of a run's form; local: offered only under kfp.local
(``llmft pipeline run-local``), a cluster run uses its default."""

INTERNAL_INPUTS = ("plan", "run_id", "compiled")
"""Inputs of the plan component that are not pipeline parameters."""


@dataclass(frozen=True)
class Declared:
    """What a parameter's ``_p(...)`` declares besides its name, type and default."""

    description: str
    """One paragraph; the KFP UI's description of the parameter (and docs/pipeline-parameters.md's)."""
    offer: Offer = "run"
    minimal: bool = False
    """Also a field of the minimal pipeline's form (the others keep their compiled values there)."""
    hpo: bool = False
    """Only the HPO pipeline (llm-finetune-hpo) has it."""
    aliases: tuple[str, ...] = ()
    """Older names of the parameter: llmft's commands and functions still accept them (with a note)."""
    local_values: str = ""
    """Values only kfp.local accepts: named in the description of the local form only."""


def _p(
    default: Any,
    description: str,
    *,
    offer: Offer = "run",
    minimal: bool = False,
    hpo: bool = False,
    was: tuple[str, ...] = (),
    local_values: str = "",
) -> Any:
    """A parameter's field: its default and its declaration (see :class:`Declared`)."""
    declared = Declared(" ".join(description.split()), offer, minimal, hpo, was, " ".join(local_values.split()))
    return field(default=default, metadata={"parameter": declared})


@dataclass(frozen=True)
class PipelineParameters:
    """Every pipeline parameter, typed. The KFP UI lists a form's parameters sorted by name (see
    docs/pipeline-parameters.md), so names carry their group's prefix and are declared in that order: the
    declaration reads as the form does (a test holds it). The ones compiled in come last."""

    # the base model (base_)
    base_model: str = _p(
        "Qwen/Qwen2.5-7B-Instruct",
        "The model to fine-tune: a Hugging Face hub id, or a directory on the volume.",
        minimal=True,
        was=("model",),
    )
    # the data (dataset)
    dataset: str = _p(
        "tatsu-lab/alpaca",
        """The raw training data: a hub dataset id, a file or folder on the volume, https://host/file.jsonl (.json,
        .csv, .parquet), or s3://bucket/key.jsonl or s3://bucket/prefix/ (credentials: s3_secret).""",
        minimal=True,
    )
    dataset_columns: str = _p(
        "",
        """The rows' columns as a format's fields, field:column pairs, e.g. "prompt:question,completion:answer"
        ('' = the columns carry the fields' names).""",
        minimal=True,
    )
    dataset_config: str = _p("", "Configuration (subset) of a hub dataset ('' = its default).")
    dataset_format: str = _p("auto", "auto, messages (OpenAI chat), sharegpt, alpaca, prompt_completion or text.")
    dataset_max_reject_fraction: float = _p(
        0.01, "Fail the prepare step when more rows than this fraction are rejected.", was=("max_reject_fraction",)
    )
    dataset_split: str = _p("train", "Split of a hub dataset to read.")
    dataset_val_fraction: float = _p(
        0.05, "Fraction of accepted rows held out for validation (0 < f < 1).", was=("val_fraction",)
    )
    # how it trains (finetune_)
    finetune_batch_size: int = _p(
        8,
        """Packed sequences (of finetune_max_length tokens) per optimizer step, over all GPUs; each GPU runs as
        many per forward pass as finetune_micro_batch_size says and accumulates the rest.""",
    )
    finetune_epochs: float = _p(1.0, "Passes over the training split (when finetune_max_steps is 0).", was=("epochs",))
    finetune_eval_every: float = _p(
        0.1,
        """Score the validation split every N optimizer steps (a whole N >= 1), or at every fraction f of the run
        (0 < f < 1: 0.1 = ten evaluations); 0 = at the end only.""",
    )
    finetune_learning_rate: float = _p(0.0002, "Peak learning rate.", minimal=True, was=("learning_rate",))
    finetune_lora_alpha: float = _p(32.0, "LoRA alpha (scale = alpha / r).", was=("lora_alpha",))
    finetune_lora_dropout: float = _p(0.05, "LoRA dropout.", was=("lora_dropout",))
    finetune_lora_r: int = _p(
        16,
        """LoRA rank (above serving_max_lora_rank the adapter is served merged; serving_mode=lora refuses
        it).""",
        minimal=True,
        was=("lora_r",),
    )
    finetune_lora_target_modules: str = _p(
        "all-linear", "Comma-separated module names, or all-linear.", was=("lora_target_modules",)
    )
    finetune_max_length: int = _p(2048, "Tokens per packed training sequence.", was=("max_length",))
    finetune_max_steps: int = _p(0, "Optimizer steps; > 0 wins over finetune_epochs.", minimal=True, was=("max_steps",))
    finetune_method: str = _p("lora", "lora, qlora or full.", minimal=True, was=("method",))
    finetune_micro_batch_size: str = _p(
        "auto",
        """Packed sequences per forward pass on each GPU, or auto (as many as fit its free memory; under
        DeepSpeed ZeRO the fastest size that fits).""",
    )
    finetune_overrides: str = _p(
        "",
        """More trainer settings as key=value pairs (docs/config-reference.md), e.g. "keep_last=3
        optim.weight_decay=0.01"; they win over the parameters.""",
        was=("train_overrides",),
    )
    finetune_packing: bool = _p(
        True, "Pack several conversations into each sequence (attention never crosses them).", was=("packing",)
    )
    finetune_save_every: float = _p(
        0.25,
        """Write a checkpoint every N optimizer steps (a whole N >= 1), or at every fraction f of the run (0 < f <
        1: 0.25 = four); the evaluate step scores each complete one, and a retried task resumes from the newest.
        0 = at the end only.""",
    )
    finetune_seed: int = _p(42, "Seed of the data split and order, LoRA init and dropout.", was=("seed",))
    finetune_warmup_ratio: float = _p(0.0, "Learning-rate warmup as a fraction of the optimizer steps.")
    # the sweep of the HPO pipeline (hpo_)
    hpo_algorithm: str = _p("tpe", "random, tpe, grid or bayesianoptimization.", hpo=True, was=("sweep_algorithm",))
    hpo_backend: str = _p(
        "katib",
        "katib (a Katib Experiment whose trials are the training job).",
        offer="local",
        hpo=True,
        was=("sweep_backend",),
        local_values="local (Optuna in the sweep step's process)",
    )
    hpo_max_failed_trials: int = _p(
        3, "Failed trials tolerated before the sweep fails.", hpo=True, was=("sweep_max_failed_trials",)
    )
    hpo_max_trials: int = _p(12, "Trials in total.", minimal=True, hpo=True, was=("sweep_max_trials",))
    hpo_overrides: str = _p(
        "",
        'More sweep settings as key=value, e.g. "space.lora_r.values=8,16 early_stopping=false".',
        hpo=True,
        was=("sweep_overrides",),
    )
    hpo_parallel_trials: int = _p(3, "Trials at once.", hpo=True, was=("sweep_parallel_trials",))
    hpo_timeout_s: int = _p(
        259200, "How long the sweep step waits for the Experiment.", hpo=True, was=("sweep_timeout_s",)
    )
    hpo_trial_overrides: str = _p(
        "",
        "Fixed trainer settings of every trial ('' = max_steps=200 eval_every=25 ...).",
        hpo=True,
        was=("sweep_trial_overrides",),
    )
    # where runs are tracked and registered (mlflow_)
    mlflow_experiment: str = _p("llm-finetune", "MLflow experiment of the training runs and the registration.")
    mlflow_model_name: str = _p("llm-adapter", "Registered model name (also the promoted adapter's folder name).")
    mlflow_tracking_uri: str = _p(
        "",
        "MLflow server, http(s)://... ('' = MLFLOW_TRACKING_URI from the mlflow Secret; neither: no MLflow, the run "
        "trains, evaluates, promotes and deploys, and registers nothing).",
        minimal=True,
    )
    # evaluation and the promotion gate (promote_)
    promote_eval_batch_size: int = _p(8, "lm-eval requests per forward pass.", was=("eval_batch_size",))
    promote_eval_limit: int = _p(
        500,
        "lm-eval documents per task and model at most (0 = all): bounds the evaluate step's time.",
        was=("eval_limit",),
    )
    promote_eval_max_questions: int = _p(
        16,
        "Held-out questions per model (at most; bounds the evaluate step's generation time).",
        was=("eval_max_questions",),
    )
    promote_eval_num_fewshot: int = _p(
        -1,
        "Few-shot examples per lm-eval question (-1 = each task's own default, usually 0).",
        was=("eval_num_fewshot",),
    )
    promote_eval_questions: str = _p(
        "",
        """JSONL file on the volume of {"question": ..., "answer": ... or [...]} for heldout ('' = the validation
        split's conversations, the last assistant turn as the reference).""",
        was=("eval_questions",),
    )
    promote_eval_tasks: str = _p(
        "heldout",
        """Tasks the evaluate step scores base and checkpoints on, comma-separated: heldout (greedy answers to
        held-out questions: SQuAD exact match and token F1, whole-word contains), velmora_mc (shipped), any
        lm-eval task, group or tag (arc_easy, mmlu_abstract_algebra, hellaswag; data from <volume>/eval-cache,
        filled by `llmft eval cache`, or a reachable hub) and task YAMLs on the volume (/data/tasks/t.yaml); '' =
        perplexity only.""",
        minimal=True,
        was=("eval_tasks",),
    )
    promote_guards: str = _p(
        "",
        """Metrics the adapter may not lose to the base, comma-separated metric[:tolerance], e.g.
        "arc_easy.acc:0.02" (two points; default 0.01) or "perplexity:0.05" (5%); '' = none.""",
        was=("eval_guards",),
    )
    promote_margin: float = _p(
        0.01,
        """Gain over the base model required to promote: relative for perplexity (0.01 = 1% lower), absolute
        points for a task score (0.01 = one point higher).""",
    )
    promote_metric: str = _p(
        "perplexity",
        """What the promote gate, the best checkpoint and the registry's champion follow: perplexity or a metric
        of a task in promote_eval_tasks, e.g. heldout.contains, heldout.exact_match, heldout.token_f1,
        arc_easy.acc.""",
        minimal=True,
    )
    # serving with KServe + vLLM (serving_)
    serving_cpu: str = _p("4", "CPU request and limit of the predictor.")
    serving_deploy: bool = _p(
        True, "Apply the InferenceService (false: write and validate its manifest only).", was=("deploy",)
    )
    serving_deploy_mode: str = _p(
        "kserve",
        "kserve (an InferenceService).",
        offer="local",
        was=("deploy_mode",),
        local_values="""local (a generation check with transformers) or vllm (a real vLLM server on this machine
        with the manifest's arguments, and the smoke test; make serving-venv)""",
    )
    serving_deploy_policy: str = _p(
        "champion",
        """champion (deploy only a version the registry made its champion; one that lost is registered, not
        served) or always.""",
        was=("deploy_policy",),
    )
    serving_deploy_timeout_s: int = _p(
        1800, "How long the deploy step waits for the InferenceService to be Ready.", was=("deploy_timeout_s",)
    )
    serving_gpus: int = _p(1, "GPUs of the predictor.")
    serving_max_lora_rank: int = _p(
        64, "vLLM --max-lora-rank of the runtime (8, 16, 32, 64, 128, 256, 320 or 512).", was=("max_lora_rank",)
    )
    serving_memory: str = _p("32Gi", "Memory request and limit of the predictor.")
    serving_mode: str = _p(
        "auto",
        """auto (the adapter as a vLLM LoRA module when vLLM can serve it, else merged into its base, the reason
        logged), lora (LoRA only: an adapter vLLM refuses fails the run) or merged (always merged: a full copy of
        the weights on the volume, served without --enable-lora).""",
    )
    serving_name: str = _p("llm-adapter", "InferenceService name (at most 45 characters).")
    serving_namespace: str = _p("", "Namespace of the InferenceService ('' = the pipeline's).", minimal=True)
    serving_prompts: str = _p(
        "",
        """Prompts, separated by ' | ', that the deploy step's check puts to base and adapter (the first one in
        the endpoint smoke test); '' = two general questions.""",
    )
    serving_runtime: str = _p("", "KServe (Cluster)ServingRuntime (default: the one compiled in).")
    # the pipeline steps' own pods (step_)
    step_cpu: str = _p(
        "1", "CPU request and limit of the light steps (plan, train and sweep launchers, promote, register, deploy)."
    )
    step_data_cpu: str = _p(
        "4",
        "CPU request and limit of prepare, tokenize and the serving-form step (which merges an adapter).",
        was=("data_cpu",),
    )
    step_data_memory: str = _p(
        "16Gi", "Memory request and limit of prepare, tokenize and the serving-form step.", was=("data_memory",)
    )
    step_eval_cpu: str = _p("8", "CPU request and limit of the evaluate step (1 GPU).", was=("eval_cpu",))
    step_eval_memory: str = _p(
        "64Gi", "Memory request and limit of the evaluate step (loads the base model).", was=("eval_memory",)
    )
    step_memory: str = _p("2Gi", "Memory request and limit of the light steps.")
    # the training job (training_)
    training_backend: str = _p(
        "pytorchjob",
        """pytorchjob (a Training Operator v1 PyTorchJob; its older name kubeflow is still accepted) or trainjob (a
        Kubeflow Trainer v2 TrainJob); the sweep's trials run on the same kind of job.""",
        local_values="local (subprocesses of the train step)",
    )
    training_cpu: str = _p("8", "CPU request and limit of each training pod (and Katib trial).", was=("worker_cpu",))
    training_gpus_per_worker: int = _p(1, "GPUs per pod (one trainer process per GPU).", was=("gpus_per_worker",))
    training_image: str = _p(
        "", "Image of the training pods and Katib trials (default: the one compiled in).", was=("trainer_image",)
    )
    training_memory: str = _p(
        "64Gi", "Memory request and limit of each training pod, including the 8Gi /dev/shm.", was=("worker_memory",)
    )
    training_runtime: str = _p(
        "torch-distributed",
        """The runtime a trainjob references: NAME of a ClusterTrainingRuntime (default: the torch-distributed one
        Kubeflow Trainer ships) or TrainingRuntime/NAME in the run's namespace.""",
    )
    training_timeout_s: int = _p(
        86400,
        """The job's activeDeadlineSeconds, and how long the train step waits for it (default one day: a stuck job
        holds its GPUs no longer; raise it for longer runs, up to the task's 3-day timeout).""",
        was=("job_timeout_s",),
    )
    training_workers: int = _p(1, "Training pods: one master plus training_workers - 1 workers.", was=("num_workers",))
    # the data volume (volume_)
    volume_path: str = _p(
        "/data",
        "Where the volume is mounted (a cluster mounts the PVC at /data).",
        offer="local",
        was=("data_root",),
    )
    volume_pvc_name: str = _p("llmft-data", "The ReadWriteMany data/checkpoint PVC.", was=("pvc_name",))
    # compiled in: the compiled YAML applies them to the KFP tasks themselves (KFP backends before 2.5 take a
    # Secret name or a node selector from no parameter), so they are never fields of a run's form
    gpu_node_selector: str = _p(
        "",
        """label=value[,label=value] the GPU pods must match ('' = none; the GPU request places them); the
        evaluate task applies it too.""",
        offer="compile",
    )
    hf_token_secret: str = _p(
        "",
        """Secret with the key HF_TOKEN for gated models and data ('' = none), NAME or NAME:KEY,...; prepare,
        tokenize, evaluate, the serving form, the training job and the InferenceService mount it.""",
        offer="compile",
    )
    langfuse_secret: str = _p(
        "",
        """Secret with LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_HOST for the traces ('' = none), NAME or
        NAME:KEY,...""",
        offer="compile",
    )
    mlflow_secret: str = _p(
        "",
        """Secret with MLflow keys ('' = none), NAME (key MLFLOW_TRACKING_URI) or NAME:KEY,... from
        MLFLOW_TRACKING_URI, _USERNAME, _PASSWORD, _TOKEN; register, evaluate, the sweep and the training job
        mount it.""",
        offer="compile",
    )
    s3_secret: str = _p(
        "",
        """Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for an s3:// dataset ('' = none, or the pod's IAM
        role), NAME or NAME:KEY,... adding AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL (MinIO, Ceph); prepare
        mounts it.""",
        offer="compile",
    )

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> PipelineParameters:
        """The parameters from ``name -> value`` (the plan step's inputs, or the pipeline's defaults with a
        command line's changes): every name present, none unknown."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown and unknown[0] in OLD_NAMES:
            raise ConfigError(f"pipeline parameter `{unknown[0]}` is now `{OLD_NAMES[unknown[0]]}`: use the new name")
        if unknown:
            raise ConfigError(unknown_name(unknown[0]))
        missing = [name for name in names if name not in values]
        if missing:
            raise ConfigError(f"pipeline parameter `{missing[0]}` is missing from the plan step's inputs")
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """name -> value of every parameter, in declaration order (``plan.json``'s ``parameters``); taken
        from ``vars``, so a test that records attribute reads sees only the builder's own."""
        return dict(vars(self))


# --- derived from the declarations ---------------------------------------------------------------


@dataclass(frozen=True)
class Parameter:
    """One declared parameter: a field of :class:`PipelineParameters` and its :class:`Declared`."""

    name: str
    type: type
    default: Any
    declared: Declared


def _declarations() -> tuple[Parameter, ...]:
    hints = typing.get_type_hints(PipelineParameters)
    return tuple(
        Parameter(f.name, hints[f.name], f.default, f.metadata["parameter"])
        for f in dataclasses.fields(PipelineParameters)
    )


PARAMETERS: tuple[Parameter, ...] = _declarations()
"""Every declared parameter, in declaration order."""
BY_NAME: dict[str, Parameter] = {p.name: p for p in PARAMETERS}
COMPILE_TIME_PARAMETERS = tuple(p.name for p in PARAMETERS if p.declared.offer == "compile")
"""The parameters the compiled YAML applies to the KFP tasks themselves: fixed when compiling."""


def compile_time_defaults() -> dict[str, str]:
    """Defaults taken from where the pipeline is compiled (llmft/components/images.py reads LLMFT_* at import)."""
    return {"training_image": images.TRAINER_IMAGE, "serving_runtime": images.SERVING_RUNTIME}


def parameter_defaults(*, hpo: bool = True) -> dict[str, Any]:
    """name -> default of every pipeline parameter (with the compile-time defaults filled in); ``hpo=False``
    leaves out the HPO pipeline's own."""
    return {**{p.name: p.default for p in PARAMETERS if hpo or not p.declared.hpo}, **compile_time_defaults()}


OLD_NAMES: dict[str, str] = {old: p.name for p in PARAMETERS for old in p.declared.aliases}
"""An older name of a parameter -> its name (docs/pipeline-parameters.md, Old names)."""


def unknown_name(name: str) -> str:
    """The one line refusing an unknown parameter name, with the closest name (an old one: by its new name)."""
    close = difflib.get_close_matches(name, [*BY_NAME, *OLD_NAMES], n=1, cutoff=0.6)
    hint = f"did you mean `{OLD_NAMES.get(close[0], close[0])}`? " if close else ""
    return f"unknown pipeline parameter `{name}`; {hint}(every parameter: docs/pipeline-parameters.md)"
