"""Embedded defaults of ``llmft pipeline run-local`` (and ``make demo``), and ``key=value`` parsing.

The local run uses the same pipeline as a cluster, with arguments that fit a 2-core CPU:
the project's tiny model (built offline into the work folder), the sample data shipped
in the package, MLflow on a SQLite file in the work folder, the ``local`` training backend
(``llmft train`` as a subprocess of the train step) and the ``local`` deploy mode (manifest +
generation check with transformers); ``serving_deploy_mode=vllm`` serves the manifest's model(s) with a real vLLM
from the serving virtualenv instead (``make serving-venv``; llmft/components/lib/serving/vllm_local.py). The
parameters themselves (names, types, defaults, forms) are declared once (llmft/components/lib/plan/parameters.py);
:func:`parse_arguments` types ``key=value`` by that declaration, for the pipeline form a command uses.

Work folder layout (default ``runs/pipeline-local``)::

    data/                the "volume": hf-cache/, datasets/, tokenized/, runs/, models/
    data/base-models/    the tiny base model
    kfp/                 kfp.local pipeline root (one folder per run, per task)
    mlflow.db            MLflow tracking + registry store; mlartifacts/ its artifacts
    run-local.log        everything the tasks printed
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from llmft.components.lib.plan.forms import Form, form_parameter, rename_note, renamed
from llmft.components.lib.plan.parameters import BY_NAME
from llmft.demo import sample_path
from llmft.demo.sample_data.generate_facts import PROBES
from llmft.trainer.config_load import parse_bool, split_assignment
from llmft.trainer.errors import ConfigError
from llmft.trainer.real_model import DEFAULT_CACHE, ensure_real_model
from llmft.trainer.tiny_model import build_tiny_model

TINY_MODEL = "tiny"
"""Value of ``base_model`` that makes run-local build and use the project's tiny model."""
SAMPLE_DATASET = "sample:alpaca_demo"
"""Value of ``dataset`` that run-local resolves to the sample shipped in llmft/demo."""
DEFAULT_WORK_DIR = "runs/pipeline-local"
REAL_WORK_DIR = "runs/pipeline-real"

LOCAL_DEFAULTS: dict[str, Any] = {
    "base_model": TINY_MODEL,
    "dataset": SAMPLE_DATASET,
    "finetune_batch_size": 4,
    "finetune_eval_every": 16,
    "finetune_learning_rate": 5e-3,
    "finetune_lora_alpha": 16.0,
    "finetune_lora_dropout": 0.0,
    "finetune_lora_r": 8,
    "finetune_max_length": 256,
    "finetune_max_steps": 64,  # about 2.7 epochs of the sample; 3e-3 x 24 steps reached perplexity 740, this 624
    "finetune_method": "lora",
    "finetune_overrides": "log_every=8 keep_last=4 schedule.warmup_steps=4 observe.progress_bar=false",
    "finetune_save_every": 16,
    "mlflow_experiment": "llmft-local",
    "mlflow_model_name": "tiny-adapter",
    "promote_margin": 0.01,
    "serving_deploy": True,
    "serving_deploy_mode": "local",
    "serving_gpus": 0,
    "serving_max_lora_rank": 8,
    "serving_name": "tiny-adapter",
    "training_backend": "local",
    "training_gpus_per_worker": 0,
    "training_timeout_s": 1800,
    "training_workers": 1,
    "volume_pvc_name": "local",
}
"""Arguments that differ from the pipeline's own (cluster) defaults."""


DEMO_PROBES = PROBES[:3]
"""The questions the demo's served models answer (each with the word a learned answer contains)."""
REAL_MODEL = "real"
"""Value of ``base_model`` that makes run-local convert (once, then cached) and use SmolLM2-135M-Instruct."""
REAL_LOCAL_DEFAULTS: dict[str, Any] = {
    "base_model": REAL_MODEL,
    "dataset": "sample:velmora_facts",
    "dataset_val_fraction": 0.1,
    "finetune_batch_size": 4,
    "finetune_eval_every": 6,
    "finetune_learning_rate": 2e-3,
    "finetune_lora_alpha": 32.0,
    "finetune_lora_r": 16,
    "finetune_max_length": 256,
    "finetune_max_steps": 12,  # about one epoch of the 180 training rows: 4 packed sequences of 256 tokens a step
    "finetune_overrides": "log_every=2 keep_last=2 schedule.warmup_steps=2 observe.progress_bar=false",
    "finetune_save_every": 6,
    "mlflow_experiment": "llmft-real",
    "mlflow_model_name": "velmora-adapter",
    "serving_deploy_mode": "vllm",
    "serving_max_lora_rank": 16,
    "serving_name": "velmora",
    "serving_prompts": " | ".join(question for question, _keyword in DEMO_PROBES),
}
"""``llmft pipeline run-local --real`` (``make demo-real``): a real pretrained model learns made-up facts
(llmft/demo/sample_data/generate_facts.py); LOCAL_DEFAULTS <- these <- the command line's."""


DEMO_QUESTIONS = 6
"""Held-out questions of the short profile: the first 6 of velmora_questions.jsonl ask its three facts."""
DEMO_DEFAULTS: dict[str, Any] = {
    **REAL_LOCAL_DEFAULTS,
    "dataset": "sample:velmora_three_facts",
    "finetune_max_steps": 6,
    # the pipeline's own defaults, fractions of the run (an evaluation every step, a checkpoint every 2 of the 6):
    # the run summary shows the eval curve a user's run shows (docs/evaluation.md, Cost: what they add here)
    "finetune_eval_every": BY_NAME["finetune_eval_every"].default,
    "finetune_save_every": BY_NAME["finetune_save_every"].default,
    "finetune_overrides": "log_every=2 keep_last=1 schedule.warmup_steps=1 observe.progress_bar=false",
    "promote_eval_max_questions": DEMO_QUESTIONS,
    "promote_eval_questions": "sample:velmora_questions",
    "promote_metric": "heldout.contains",
    "serving_deploy_mode": "local",
}
"""``llmft pipeline run-local`` (``make demo``): the short profile of the real model. The rows of three made-up
facts (75), 6 LoRA steps evaluated at every step and checkpointed every 2 (the pipeline's fractional defaults:
the summary's curve), the last and the best checkpoint kept; the evaluate step scores base and adapters on
held-out phrasings of those facts (contains the fact's keyword), the promote gate follows that score, and the
deploy step's check generates with transformers (no vLLM). LOCAL_DEFAULTS <- these <- the command line's."""
TINY_WORK_DIR = "runs/pipeline-tiny"

OWN_DATA_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in REAL_LOCAL_DEFAULTS.items() if k not in ("dataset", "serving_prompts")},
    "mlflow_experiment": "llmft-local",
    "mlflow_model_name": "my-adapter",
    "serving_deploy_mode": "local",
    "serving_name": "my-adapter",
}
"""``llmft pipeline run-local dataset=<your data>``: the real model's CPU settings (LoRA r16, 12 steps, 256 tokens)
without the demo's made-up facts: no held-out Velmora questions, the gate on perplexity (the pipeline's default),
the deploy check's two general questions. LOCAL_DEFAULTS <- these <- the command line's."""


def local_profile(overrides: dict[str, Any], *, real: bool, tiny: bool) -> tuple[str, dict[str, Any]]:
    """(name, defaults) of a local run: ``tiny`` (the random-weight plumbing run), ``real`` (make demo-real),
    ``own-data`` (a ``dataset`` of the user's: nothing of the demo's facts applies to it) or ``demo`` (make demo)."""
    if tiny:
        return "tiny", {}
    if real:
        return "real", REAL_LOCAL_DEFAULTS
    if "dataset" in overrides:
        return "own-data", OWN_DATA_DEFAULTS
    return "demo", DEMO_DEFAULTS


def pipeline_inputs(pipeline=None) -> dict[str, Any]:
    """name -> InputSpec of a compiled pipeline's run parameters (type and default)."""
    if pipeline is None:
        # heavy: kfp
        from llmft.pipelines.llm_finetune import llm_finetune_pipeline as pipeline
    return dict(pipeline.component_spec.inputs or {})


def _coerce(name: str, raw: str, kind: type) -> Any:
    try:
        if kind is bool:
            return parse_bool(raw)
        return kind(raw)
    except ValueError:
        raise ConfigError(f"pipeline parameter `{name}`: {raw!r} is not a valid {KIND_NAMES[kind]}") from None


KIND_NAMES = {bool: "boolean", int: "integer", float: "float", str: "string"}


def parse_arguments(items: list[str], form: Form | None = None) -> dict[str, Any]:
    """``["finetune_lora_r=16", "serving_deploy=false"]`` -> typed arguments of the pipeline of ``form`` (default:
    the full one): its run parameters and the ones it compiles in, by the declarations' types. An older name
    works, with a note on stderr; an unknown one, or one this form cannot take, is refused in one line."""
    form = form or Form()
    out: dict[str, Any] = {}
    for item in items:
        name, raw = split_assignment(item, "finetune_lora_r=16")
        name = name.replace("-", "_")
        parameter = form_parameter(name, form)
        if name != parameter.name:
            print(f"note: {rename_note(name)}", file=sys.stderr)
        if parameter.name in out:
            raise ConfigError(f"pipeline parameter `{parameter.name}` is given twice")
        out[parameter.name] = _coerce(parameter.name, raw, parameter.type)
    return out


def run_arguments(arguments: dict[str, Any], form: Form) -> dict[str, Any]:
    """The part of ``arguments`` that are run parameters of ``form`` (the rest is compiled in)."""
    offered = {p.name for p in form.offered()}
    return {name: value for name, value in arguments.items() if name in offered}


def resolve_local_arguments(
    overrides: dict[str, Any], work_dir: str | Path, extra_defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """LOCAL_DEFAULTS <- extra_defaults <- overrides (older names accepted), with the tiny model built, the
    sample resolved and paths filled in."""
    work = Path(work_dir).resolve()
    args = {**LOCAL_DEFAULTS, **(extra_defaults or {}), **renamed(overrides)}
    volume = Path(args.get("volume_path") or work / "data")
    args["volume_path"] = str(volume)
    if args["base_model"] == TINY_MODEL:
        args["base_model"] = str(ensure_tiny_model(volume / "base-models" / "tiny-model"))
    elif args["base_model"] == REAL_MODEL:
        # on the "volume", as KServe (and serving_deploy_mode=vllm) serve a base model: copied from the shared cache
        target = volume / "base-models" / "smollm2-135m-instruct"
        args["base_model"] = str(ensure_real_model(target, cache=Path(DEFAULT_CACHE).resolve()))
    for name in ("dataset", "promote_eval_questions"):  # shipped samples (llmft/demo/sample_data)
        if str(args.get(name, "")).startswith("sample:"):
            args[name] = str(sample_path(str(args[name]).split(":", 1)[1]))
    args.setdefault("mlflow_tracking_uri", f"sqlite:///{work / 'mlflow.db'}")
    return args


def ensure_tiny_model(path: Path) -> Path:
    """Build the tiny model at ``path`` unless a complete one is already there (deterministic seed)."""
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path

    return build_tiny_model(path)
