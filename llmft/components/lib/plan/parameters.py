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
* the defaults (:func:`parameter_defaults`), ``key=value`` typing of the CLI, and
  docs/pipeline-parameters.md (generated, held fresh by a test).

A parameter that sets a trainer setting names it on the trainer's field (llmft/trainer/config.py,
``Setting(..., pipeline=<parameter name>)``); tests/pipeline/test_pipeline_parameters.py holds its default
to the trainer field's.
"""

from __future__ import annotations

import dataclasses
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

PIPELINE_NAME = "llm-finetune"
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
    declared = Declared(" ".join(description.split()), offer, minimal, hpo, was, local_values)
    return field(default=default, metadata={"parameter": declared})


@dataclass(frozen=True)
class PipelineParameters:
    """Every pipeline parameter, typed, in the order the forms list them."""

    model: str = _p("Qwen/Qwen2.5-7B-Instruct", "Base model: a Hugging Face hub id or a directory on the volume.")
    dataset: str = _p("tatsu-lab/alpaca", "Raw data: a hub dataset id or a file/folder on the volume.")
    dataset_format: str = _p("auto", "auto, openai (messages), sharegpt, alpaca, prompt_completion or text.")
    dataset_split: str = _p("train", "Split of a hub dataset to read.")
    val_fraction: float = _p(0.05, "Fraction of accepted rows held out for validation (0 < f < 1).")
    max_reject_fraction: float = _p(0.01, "Fail the prepare step when more rows than this fraction are rejected.")
    max_length: int = _p(2048, "Tokens per packed training sequence.")
    packing: bool = _p(True, "Pack several conversations into each sequence (attention never crosses them).")
    method: str = _p("lora", "lora, qlora or full.")
    lora_r: int = _p(16, "LoRA rank (above max_lora_rank the adapter is served merged; serving_mode=lora refuses it).")
    lora_alpha: float = _p(32.0, "LoRA alpha (scale = alpha / r).")
    lora_dropout: float = _p(0.05, "LoRA dropout.")
    lora_target_modules: str = _p("all-linear", "Comma-separated module names, or all-linear.")
    learning_rate: float = _p(0.0002, "Peak learning rate.")
    epochs: float = _p(1.0, "Passes over the training split (when max_steps is 0).")
    max_steps: int = _p(0, "Optimizer steps; > 0 wins over epochs.")
    seed: int = _p(42, "Seed of the data split and order, LoRA init and dropout.")
    train_overrides: str = _p("", 'More trainer settings as key=value pairs, e.g. "save_every=200 eval_every=100".')
    sweep_backend: str = _p(
        "katib",
        "katib (a Katib Experiment of PyTorchJob trials) or local (Optuna under kfp.local only).",
        hpo=True,
    )
    sweep_algorithm: str = _p("tpe", "random, tpe, grid or bayesianoptimization.", hpo=True)
    sweep_max_trials: int = _p(12, "Trials in total.", hpo=True)
    sweep_parallel_trials: int = _p(3, "Trials at once.", hpo=True)
    sweep_max_failed_trials: int = _p(3, "Failed trials tolerated before the sweep fails.", hpo=True)
    sweep_overrides: str = _p(
        "", 'More sweep settings as key=value, e.g. "space.lora_r.values=8,16 early_stopping=false".', hpo=True
    )
    sweep_trial_overrides: str = _p(
        "", "Fixed trainer settings of every trial ('' = max_steps=200 eval_every=25 ...).", hpo=True
    )
    sweep_timeout_s: int = _p(259200, "How long the sweep step waits for the Experiment.", hpo=True)
    training_backend: str = _p(
        "kubeflow",
        """kubeflow (a PyTorchJob), trainjob (a Kubeflow Trainer v2 TrainJob) or local (subprocesses of the step,
        kfp.local only). The sweep's trials run on the same kind of job.""",
    )
    training_runtime: str = _p(
        "torch-distributed",
        """The runtime a trainjob references: NAME of a ClusterTrainingRuntime (default: the torch-distributed one
        Kubeflow Trainer ships) or TrainingRuntime/NAME in the run's namespace.""",
    )
    num_workers: int = _p(1, "PyTorchJob pods: one Master plus num_workers - 1 Workers.")
    gpus_per_worker: int = _p(1, "GPUs per pod (one trainer process per GPU).")
    worker_cpu: str = _p("8", "CPU request and limit of each training pod (and Katib trial).")
    worker_memory: str = _p("64Gi", "Memory request and limit of each training pod, including the 8Gi /dev/shm.")
    gpu_node_selector: str = _p(
        "",
        """label=value[,label=value] the GPU pods must match ('' = none; the GPU request places them). Fixed when
        compiling (the evaluate task applies it).""",
    )
    job_timeout_s: int = _p(
        86400,
        """The job's activeDeadlineSeconds, and how long the train step waits for it (default one day: a stuck job
        holds its GPUs no longer; raise it for longer runs, up to the task's 3-day timeout).""",
    )
    trainer_image: str = _p("", "Image of the training pods and Katib trials (default: the one compiled in).")
    pvc_name: str = _p("llmft-data", "The ReadWriteMany data/checkpoint PVC.")
    data_root: str = _p("/data", "Where the PVC is mounted (keep /data on a cluster).")
    hf_token_secret: str = _p(
        "",
        """Secret with the key HF_TOKEN for gated models/data ('' = none). NAME or NAME:KEY,... Fixed when
        compiling (prepare, tokenize and evaluate mount it).""",
    )
    mlflow_secret: str = _p(
        "",
        """Secret with MLflow keys, NAME (key MLFLOW_TRACKING_URI) or NAME:KEY,... from MLFLOW_TRACKING_URI,
        _USERNAME, _PASSWORD, _TOKEN ('' = none). Fixed when compiling (register mounts it).""",
    )
    langfuse_secret: str = _p(
        "",
        """Secret with LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_HOST for the trainer's traces ('' =
        none). NAME or NAME:KEY,...""",
    )
    step_cpu: str = _p(
        "1", "CPU request and limit of the light steps (plan, train and sweep launchers, promote, register, deploy)."
    )
    step_memory: str = _p("2Gi", "Memory request and limit of the light steps.")
    data_cpu: str = _p(
        "4", "CPU request and limit of prepare, tokenize and the serving-form step (which merges an adapter)."
    )
    data_memory: str = _p("16Gi", "Memory request and limit of prepare, tokenize and the serving-form step.")
    eval_cpu: str = _p("8", "CPU request and limit of the evaluate step (1 GPU).")
    eval_memory: str = _p("64Gi", "Memory request and limit of the evaluate step (loads the base model).")
    mlflow_tracking_uri: str = _p("", "MLflow server ('' = MLFLOW_TRACKING_URI from mlflow_secret).")
    mlflow_experiment: str = _p("llm-finetune", "MLflow experiment of the training runs and the registration.")
    mlflow_model_name: str = _p("llm-adapter", "Registered model name (also the promoted adapter's folder name).")
    promote_margin: float = _p(
        0.01,
        """Gain over the base model required to promote: relative for perplexity (0.01 = 1% lower), absolute
        points for a task score (0.01 = one point higher).""",
    )
    promote_metric: str = _p(
        "perplexity",
        """What the promote gate, the best checkpoint and the registry's champion follow: perplexity or a metric
        of a task in eval_tasks, e.g. heldout.contains, heldout.exact_match, heldout.token_f1.""",
    )
    eval_tasks: str = _p(
        "heldout",
        """Tasks the evaluate step scores base and checkpoints on, comma-separated: heldout (greedy answers to
        held-out questions: exact match, contains, token F1) and the lm-eval tasks shipped in
        llmft/trainer/assets/lm_eval_tasks (run offline); '' = perplexity only.""",
    )
    eval_questions: str = _p(
        "",
        """JSONL file on the volume of {"question": ..., "answer": ...} for heldout ('' = the validation split's
        conversations, the last assistant turn as the reference).""",
    )
    eval_max_questions: int = _p(
        16, "Held-out questions per model (at most; bounds the evaluate step's generation time)."
    )
    deploy: bool = _p(True, "Apply the InferenceService (false: write and validate its manifest only).")
    deploy_mode: str = _p(
        "kserve",
        """kserve, local (a generation check with transformers, kfp.local only) or vllm (a real vLLM server on
        this machine with the manifest's arguments, and the smoke test; kfp.local only, make serving-venv).""",
    )
    deploy_policy: str = _p(
        "champion",
        """champion (deploy only a version the registry made its champion; one that lost is registered, not
        served) or always.""",
    )
    serving_mode: str = _p(
        "auto",
        """auto (the adapter as a vLLM LoRA module when vLLM can serve it, else merged into its base, the reason
        logged), lora (LoRA only: an adapter vLLM refuses fails the run) or merged (always merged: a full copy of
        the weights on the volume, served without --enable-lora).""",
    )
    serving_name: str = _p("llm-adapter", "InferenceService name (at most 45 characters).")
    serving_namespace: str = _p("", "Namespace of the InferenceService ('' = the pipeline's).")
    serving_gpus: int = _p(1, "GPUs of the predictor.")
    serving_cpu: str = _p("4", "CPU request and limit of the predictor.")
    serving_memory: str = _p("32Gi", "Memory request and limit of the predictor.")
    serving_runtime: str = _p("", "KServe (Cluster)ServingRuntime (default: the one compiled in).")
    max_lora_rank: int = _p(64, "vLLM --max-lora-rank of the runtime (8, 16, 32, 64, 128, 256, 320 or 512).")
    serving_prompts: str = _p(
        "",
        """Prompts, separated by ' | ', that the deploy step's check puts to base and adapter (the first one in
        the endpoint smoke test); '' = two general questions.""",
    )
    deploy_timeout_s: int = _p(1800, "How long the deploy step waits for the InferenceService to be Ready.")

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> PipelineParameters:
        """The parameters from ``name -> value`` (the plan step's inputs, or the pipeline's defaults with a
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


@dataclass(frozen=True)
class Form:
    """Which parameters one compiled pipeline offers as run parameters (the others are compiled in as constants).

    ``hpo``: the sweep pipeline (its ``hpo`` parameters too); ``minimal``: only the parameters declared
    ``minimal``; ``local``: the form kfp.local runs (``llmft pipeline run-local``), which also offers the
    ``local`` ones. A ``compile`` parameter is never offered."""

    hpo: bool = False
    minimal: bool = False
    local: bool = False

    @property
    def pipeline_name(self) -> str:
        return PIPELINE_NAME + ("-hpo" if self.hpo else "") + ("-minimal" if self.minimal else "")

    def has(self, parameter: Parameter) -> bool:
        """Whether the plan of this pipeline reads the parameter at all (the HPO ones only in the HPO pipeline)."""
        return self.hpo or not parameter.declared.hpo

    def offers(self, parameter: Parameter) -> bool:
        """Whether the parameter is a run parameter (a field of the KFP UI's form) of this pipeline."""
        offer = parameter.declared.offer
        if not self.has(parameter) or offer == "compile" or (offer == "local" and not self.local):
            return False
        return parameter.declared.minimal or not self.minimal

    def offered(self) -> tuple[Parameter, ...]:
        return tuple(p for p in PARAMETERS if self.offers(p))

    def description(self, parameter: Parameter) -> str:
        """The parameter's description in this form (values only kfp.local accepts are named in the local form)."""
        text = parameter.declared.description
        if self.local and parameter.declared.local_values:
            text += f" Under kfp.local also: {parameter.declared.local_values}."
        return text


def compile_time_defaults() -> dict[str, str]:
    """Defaults taken from where the pipeline is compiled (llmft/components/images.py reads LLMFT_* at import)."""
    return {"trainer_image": images.TRAINER_IMAGE, "serving_runtime": images.SERVING_RUNTIME}


def parameter_defaults(*, hpo: bool = True) -> dict[str, Any]:
    """name -> default of every pipeline parameter (with the compile-time defaults filled in); ``hpo=False``
    leaves out the HPO pipeline's own."""
    form = Form(hpo=hpo)
    return {**{p.name: p.default for p in PARAMETERS if form.has(p)}, **compile_time_defaults()}
