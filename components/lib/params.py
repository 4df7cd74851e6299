"""Pipeline parameters -> the trainer's ``key=value`` overrides, and the fail-fast check.

The first pipeline step (prepare) calls :func:`validate_pipeline_inputs` before it reads a
single row, so a typo in a learning rate, a LoRA rank above what vLLM is configured to
serve, or an unknown backend fails in seconds on a CPU pod, before any GPU is requested.
The train step builds the trainer's command line with :func:`trainer_overrides`; both
backends (PyTorchJob and local torchrun) pass the same list.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from llmft.trainer.errors import ConfigError

TRAINING_BACKENDS = ("kubeflow", "local")
DEPLOY_MODES = ("kserve", "local")
# Keys the pipeline sets itself; extra overrides may not change them.
PIPELINE_OWNED_KEYS = ("model.name_or_path", "data", "output_dir", "method", "resume")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class TrainingParams:
    """The training settings exposed as pipeline parameters."""

    model: str
    """Base model: a hub id or a directory."""
    method: str = "lora"
    """lora, qlora or full."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: float = 32.0
    """LoRA alpha (scale = alpha / r)."""
    lora_dropout: float = 0.05
    """LoRA dropout."""
    lora_target_modules: str = "all-linear"
    """Comma-separated module names, or all-linear."""
    learning_rate: float = 2e-4
    """Peak learning rate."""
    epochs: float = 1.0
    """Passes over the training split (when max_steps <= 0)."""
    max_steps: int = 0
    """Optimizer steps; <= 0 means use epochs."""
    seed: int = 42
    """Seed of data order, LoRA init and dropout."""
    extra_overrides: str = ""
    """More trainer settings as whitespace-separated key=value pairs (e.g. "save_every=50 eval_every=50")."""


def extra_override_list(text: str) -> list[str]:
    """Split the free-form overrides, refusing keys the pipeline owns."""
    items = shlex.split(text or "")
    for item in items:
        key = item.split("=", 1)[0].strip()
        if "=" not in item:
            raise ConfigError(f"train_overrides: `{item}` is not key=value (e.g. save_every=50)")
        if key in PIPELINE_OWNED_KEYS:
            raise ConfigError(f"train_overrides: `{key}` is set by the pipeline; use the pipeline parameter instead")
    return items


def trainer_overrides(params: TrainingParams, *, data_dir: str, output_dir: str) -> list[str]:
    """The ``key=value`` list the trainer gets on every backend."""
    overrides = [
        f"model.name_or_path={params.model}",
        f"data={data_dir}",
        f"output_dir={output_dir}",
        f"method={params.method}",
        f"lora.r={params.lora_r}",
        f"lora.alpha={params.lora_alpha}",
        f"lora.dropout={params.lora_dropout}",
        f"lora.target_modules={params.lora_target_modules}",
        f"optim.lr={params.learning_rate}",
        f"seed={params.seed}",
        "resume=auto",  # a retried task continues from the newest complete checkpoint
    ]
    if params.max_steps > 0:
        overrides.append(f"max_steps={params.max_steps}")
    else:
        overrides += ["max_steps=0", f"epochs={params.epochs}"]
    return overrides + extra_override_list(params.extra_overrides)


def validate_training(params: TrainingParams):
    """Load the trainer config the train step will use; raises ConfigError naming the field."""
    from llmft.trainer.config import load_config

    try:
        return load_config(None, trainer_overrides(params, data_dir="<tokenized>", output_dir="<run>"))
    except ConfigError as exc:
        raise ConfigError(f"pipeline training parameters: {exc}") from None


@dataclass(frozen=True)
class PipelineChecks:
    """The non-training pipeline parameters checked before any work starts."""

    training_backend: str
    """kubeflow (PyTorchJob) or local (torchrun in the step's pod)."""
    num_workers: int
    """PyTorchJob replicas (Master + Workers)."""
    gpus_per_worker: int
    """GPUs per replica (0 = CPU training)."""
    max_length: int
    """Tokens per packed sequence."""
    val_fraction: float
    """Fraction of rows held out for validation."""
    max_reject_fraction: float
    """Tolerated fraction of rejected rows."""
    promote_margin: float
    """Relative perplexity improvement over the base model required to promote."""
    pvc_name: str
    """Data/checkpoint PVC name."""
    mlflow_model_name: str
    """Registered model name."""
    deploy: bool
    """Whether to apply the InferenceService."""
    deploy_mode: str
    """kserve or local."""
    serving_name: str
    """InferenceService name."""
    max_lora_rank: int
    """vLLM --max-lora-rank of the serving runtime."""


def validate_pipeline_inputs(checks: PipelineChecks, training: TrainingParams) -> list[str]:
    """Raise ConfigError on the first bad parameter; return warnings."""
    rules = [
        (
            "training_backend",
            checks.training_backend in TRAINING_BACKENDS,
            f"must be one of {', '.join(TRAINING_BACKENDS)}",
        ),
        ("deploy_mode", checks.deploy_mode in DEPLOY_MODES, f"must be one of {', '.join(DEPLOY_MODES)}"),
        ("num_workers", checks.num_workers >= 1, "must be >= 1"),
        ("gpus_per_worker", checks.gpus_per_worker >= 0, "must be >= 0"),
        ("max_length", checks.max_length >= 16, "must be >= 16 tokens"),
        ("val_fraction", 0.0 < checks.val_fraction < 1.0, "must be in (0, 1)"),
        ("max_reject_fraction", 0.0 <= checks.max_reject_fraction <= 1.0, "must be in [0, 1]"),
        ("promote_margin", 0.0 <= checks.promote_margin < 1.0, "must be in [0, 1), e.g. 0.01 for 1%"),
        ("mlflow_model_name", bool(checks.mlflow_model_name.strip()), "must not be empty"),
        ("model", bool(training.model.strip()), "must name a hub id or a model directory"),
    ]
    if checks.training_backend == "kubeflow":
        rules.append(
            ("pvc_name", bool(DNS1123.match(checks.pvc_name)), "must be a Kubernetes name (lowercase, digits, '-')")
        )
    if checks.deploy and checks.deploy_mode == "kserve":
        rules.append(
            (
                "serving_name",
                bool(DNS1123.match(checks.serving_name)) and len(checks.serving_name) <= 45,
                "must be a Kubernetes name of at most 45 characters",
            )
        )
    for name, ok, message in rules:
        if not ok:
            raise ConfigError(f"pipeline parameter `{name}` {message}")
    config = validate_training(training)
    return _serving_checks(checks, config)


def _serving_checks(checks: PipelineChecks, config) -> list[str]:
    if config.method == "full":
        return []
    if config.lora.use_dora and checks.deploy:
        raise ConfigError(
            "pipeline parameters: lora.use_dora=true (DoRA) cannot be served by vLLM; set deploy=false "
            "or train a plain LoRA adapter"
        )
    from llmft.components.lib.servability import VLLM_MAX_LORA_RANKS

    if checks.deploy and checks.max_lora_rank not in VLLM_MAX_LORA_RANKS:
        raise ConfigError(
            f"pipeline parameter `max_lora_rank`={checks.max_lora_rank}: vLLM accepts only "
            f"{', '.join(map(str, VLLM_MAX_LORA_RANKS))}"
        )
    if config.lora.r > checks.max_lora_rank:
        raise ConfigError(
            f"pipeline parameter `lora_r`={config.lora.r} exceeds `max_lora_rank`={checks.max_lora_rank} of the "
            "vLLM runtime: vLLM would refuse the adapter. Lower lora_r or raise max_lora_rank"
        )
    return []


DATA_MOUNT = "/data"
"""Where the data/checkpoint PVC is mounted in every pipeline pod and PyTorchJob replica."""


@dataclass(frozen=True)
class DataLayout:
    """Folders on the shared volume (the PVC on a cluster; a local folder for run-local).

    ``<root>/hf-cache`` HF_HOME; ``datasets/<run>`` prepared JSONL; ``tokenized/<cache key>``
    packed shards, reused by any run with the same key; ``runs/<run>`` checkpoints and
    metrics; ``models/<registered name>/<run>`` promoted adapters that KServe serves.
    """

    root: str
    """Mount path of the volume (DATA_MOUNT on a cluster)."""

    def prepared(self, run_id: str) -> str:
        return f"{self.root}/datasets/{run_id}"

    def tokenized(self, cache_key: str) -> str:
        return f"{self.root}/tokenized/{cache_key}"

    def run_dir(self, run_id: str) -> str:
        return f"{self.root}/runs/{run_id}"

    def promoted(self, model_name: str, run_id: str) -> str:
        return f"{self.root}/models/{model_name}/{run_id}"

    @property
    def hf_home(self) -> str:
        return f"{self.root}/hf-cache"

    def relative(self, path: str) -> str:
        """``path`` relative to the volume root (for ``pvc://<pvc>/<relative>`` storage URIs)."""
        root = self.root.rstrip("/") + "/"
        if not path.startswith(root):
            raise ConfigError(f"{path} is not on the data volume mounted at {self.root}")
        return path[len(root) :]

    def use_hf_cache(self) -> None:
        """Point HF_HOME at the shared cache unless the environment already sets it."""
        import os

        os.environ.setdefault("HF_HOME", self.hf_home)
