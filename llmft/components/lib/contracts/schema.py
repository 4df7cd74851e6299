"""The plan's schema: its dataclasses (RunPlan and its parts), its version, and ``plan.json`` read and write.

llmft/components/lib/plan/build.py builds a plan; every later step reads one. The rest of the contracts layer,
which every concern of llmft/components/lib shares and which imports none of them: the values a setting chooses
from (choices.py), the run's jobs, labels and job errors (run_jobs.py), pod parts (pod_parts.py), metric
definitions (metrics.py), folder names on the volume (volume_paths.py). No module of llmft/components/lib is
imported here (tests/core/test_imports.py fails on any import cycle).
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmft.trainer.config import TrainConfig
from llmft.trainer.config_load import config_from_dict, split_assignment
from llmft.trainer.errors import ConfigError

DEFAULT_RUNTIME = "torch-distributed"
"""The ClusterTrainingRuntime a default Kubeflow Trainer v2 install ships (manifests/base/runtimes)."""

PLAN_SCHEMA_VERSION = 4
"""Version of plan.json's layout; :func:`read_plan` refuses any other. Bump it whenever a field of the plan's
dataclasses is added, removed or renamed: a reader fills a missing field with its default and drops one it does
not know, so across versions a plan is misread, not refused (3: the evaluation's resolved task specs, guards,
limits and eval cache, and the registry's ``enabled``; a version-2 plan read as 3 ran no task, and a version-3
plan read as 2 promoted without its guards). tests/pipeline/test_plan_schema_version.py holds the layout of
each version and goes red when the layout changes under the same number."""
PLAN_FILE = "plan.json"
DATA_MOUNT = "/data"
"""Where the data/checkpoint PVC is mounted in every pipeline pod and job replica."""


# --- the plan's dataclasses -------------------------------------------------------------------


@dataclass(frozen=True)
class DataLayout:
    """Folders on the shared volume (the PVC on a cluster; a local folder for run-local).

    ``<root>/hf-cache`` HF_HOME; ``eval-cache`` lm-eval task data; ``datasets/<run>`` prepared JSONL;
    ``tokenized/<cache key>`` packed shards, reused by any run with the same key; ``runs/<run>`` checkpoints and
    metrics; ``sweeps/<experiment>`` trials; ``models/<registered name>/<run>`` promoted adapters;
    ``merged/<registered name>/<run>`` the promoted adapter merged into its base (serving form ``merged``).
    """

    root: str
    """Mount path of the volume (DATA_MOUNT on a cluster)."""

    def prepared(self, run_id: str) -> str:
        return f"{self.root}/datasets/{run_id}"

    def tokenized(self, cache_key: str) -> str:
        return f"{self.root}/tokenized/{cache_key}"

    def run_dir(self, run_id: str) -> str:
        return f"{self.root}/runs/{run_id}"

    def sweep_dir(self, experiment: str) -> str:
        return f"{self.root}/sweeps/{experiment}"

    def promoted(self, model_name: str, run_id: str) -> str:
        return f"{self.root}/models/{model_name}/{run_id}"

    def merged(self, model_name: str, run_id: str) -> str:
        return f"{self.root}/merged/{model_name}/{run_id}"

    @property
    def hf_home(self) -> str:
        return f"{self.root}/hf-cache"

    @property
    def eval_cache(self) -> str:
        """The offline lm-eval data cache (``llmft eval cache``; lib/evaluation/eval_cache.py)."""
        return f"{self.root}/eval-cache"

    def hf_env(self) -> dict[str, str]:
        """HF_HOME on the volume plus the caches an image may set on its own (which would win
        over HF_HOME): every download lands in the shared cache."""
        return {
            "HF_HOME": self.hf_home,
            "HF_HUB_CACHE": f"{self.hf_home}/hub",
            "HF_DATASETS_CACHE": f"{self.hf_home}/datasets",
        }

    def relative(self, path: str) -> str:
        """``path`` relative to the volume root (for ``pvc://<pvc>/<relative>`` storage URIs)."""
        root = self.root.rstrip("/") + "/"
        if not path.startswith(root):
            raise ConfigError(f"{path} is not on the data volume mounted at {self.root}")
        return path[len(root) :]

    def use_hf_cache(self) -> None:
        """Point the Hugging Face caches at the volume, over whatever the image sets (call it
        before importing transformers/datasets: huggingface_hub reads them at import)."""
        os.environ.pop("TRANSFORMERS_CACHE", None)
        os.environ.pop("HUGGINGFACE_HUB_CACHE", None)
        os.environ.update(self.hf_env())


@dataclass(frozen=True)
class Resources:
    """CPU and memory of a pod: each value is both the request and the limit."""

    cpu: str
    """Kubernetes CPU quantity, e.g. ``"4"`` or ``"500m"``."""
    memory: str
    """Kubernetes memory quantity, e.g. ``"16Gi"``."""


@dataclass(frozen=True)
class SecretMount:
    """One Kubernetes Secret whose keys become environment variables of the same names."""

    kind: str
    """hf, mlflow, langfuse or s3 (SECRET_KINDS)."""
    name: str
    """The Secret's name."""
    keys: tuple[str, ...]
    """Keys mounted (each key is also the variable's name); every key must exist."""


@dataclass(frozen=True)
class Images:
    """Images and the serving runtime the launched jobs use (the components' own are compiled in)."""

    trainer: str
    """Image of every PyTorchJob replica and Katib trial."""
    serving_runtime: str
    """KServe (Cluster)ServingRuntime of the InferenceService."""


@dataclass(frozen=True)
class DataPlan:
    """What prepare and tokenize do."""

    dataset: str
    format: str
    split: str
    val_fraction: float
    max_reject_fraction: float
    seed: int
    max_length: int
    packing: bool
    prepared_dir: str
    """Where prepare writes the validated JSONL."""
    config: str = ""
    """A hub dataset's configuration name ('' = its default)."""
    columns: str = ""
    """The column mapping, ``field:column,...`` (llmft/trainer/data/columns.py), checked by the plan step."""


@dataclass(frozen=True)
class TrainerPlan:
    """The trainer's resolved config, built and validated once by the plan step, which writes it as
    ``<run_dir>/config.yaml`` (:data:`config_path`): the job runs ``llmft train --config <config_path>``
    plus only what is decided after the plan (:meth:`launch`)."""

    config: TrainConfig
    """Every trainer setting, typed (``config.lora.r`` is the pipeline's ``finetune_lora_r``)."""
    config_path: str
    """``<run_dir>/config.yaml`` on the volume."""
    user_overrides: tuple[str, ...] = ()
    """The ``finetune_overrides`` part alone (the sweep warns when its best values replace one)."""

    @property
    def model(self) -> str:
        return self.config.model.name_or_path

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def run_dir(self) -> str:
        """output_dir of the run: stable across retries, so a retry resumes."""
        return self.config.output_dir

    @property
    def revision(self) -> str | None:
        """``model.revision``: the tokenize step reads the tokenizer the trainer loads."""
        return self.config.model.revision or None

    def launch(self, data_dir: str, extra: typing.Sequence[str] = ()) -> TrainerLaunch:
        """The trainer's arguments: this config plus what only a later step knows, the tokenized data
        ``data_dir`` (its path holds tokenize's cache key) and ``extra``, ``key=value`` items of a
        sweep's best (which win)."""
        return TrainerLaunch(self.config_path, post_plan_overrides(data_dir, extra))


def post_plan_overrides(data_dir: str, extra: typing.Sequence[str] = ()) -> dict[str, str]:
    """``{"data": data_dir, <key>: <value> of each extra item}`` (the one key=value grammar)."""
    return {"data": data_dir, **dict(split_assignment(item) for item in extra)}


@dataclass(frozen=True)
class TrainerLaunch:
    """What ``llmft train`` is started with: ``--config config_path`` then ``key=value`` of ``overrides``."""

    config_path: str | None
    """The resolved config on the volume (None: the trainer's defaults)."""
    overrides: Mapping[str, Any]
    """Settings decided after the plan only (the tokenized data, a sweep's best, Katib's trial values)."""


UNKNOWN_GRACE_S = 600
"""A training pod's grace period when its checkpoint's size is not known at plan time (jobs/grace.py)."""


@dataclass(frozen=True)
class JobPlan:
    """Inputs of the training job (PyTorchJob) and of every Katib trial."""

    backend: str
    name: str
    """PyTorchJob name, stable for the run (a retried task finds it)."""
    num_workers: int
    gpus_per_worker: int
    resources: Resources
    node_selector: dict[str, str]
    timeout_s: int
    pvc_name: str
    mount_path: str
    image: str
    env: dict[str, str]
    """Plain variables (never credentials): HF caches on the volume, an explicit MLflow URI."""
    secrets: tuple[SecretMount, ...]
    labels: dict[str, str]
    runtime: str = DEFAULT_RUNTIME
    """Backend trainjob: the (Cluster)TrainingRuntime the TrainJob references (NAME or TrainingRuntime/NAME)."""
    termination_grace_s: int = UNKNOWN_GRACE_S
    """``terminationGracePeriodSeconds`` of every training pod: time to commit the SIGTERM checkpoint, sized by the
    plan from the checkpoint's estimated size (llmft/components/lib/jobs/grace.py; 600 when unknown)."""


@dataclass(frozen=True)
class SweepPlan:
    """The HPO pipeline's sweep step (None in the plain pipeline)."""

    backend: str
    experiment: str
    settings: tuple[str, ...]
    """``key=value`` of katib.experiment.SweepSpec (algorithm, trial counts, space.*)."""
    trial_overrides: tuple[str, ...]
    """Fixed trainer settings of every trial."""
    timeout_s: int
    workdir: str
    """``<root>/sweeps/<experiment>``."""


@dataclass(frozen=True)
class RegistryPlan:
    """Promote and register."""

    tracking_uri: str
    """'' = MLFLOW_TRACKING_URI from the environment (the mlflow Secret)."""
    experiment: str
    model_name: str
    promote_margin: float
    promoted_dir: str
    promote_metric: str = "perplexity"
    """What the promote gate, the best checkpoint and the champion follow (lib/contracts/metrics.py)."""
    enabled: bool = True
    """False: no MLflow server is configured (an empty mlflow_tracking_uri, no mlflow Secret with the key, and off a
    cluster no MLFLOW_TRACKING_URI): nothing is tracked or registered; register records "not registered", deploy
    serves the promoted adapter (llmft/components/lib/plan/checks.py ``check_tracking``)."""


@dataclass(frozen=True)
class EvalTaskPlan:
    """One task of ``promote_eval_tasks`` as the plan step found it (llmft/components/lib/evaluation/task_plan.py)."""

    name: str
    """What ``promote_eval_tasks`` says: heldout, a shipped task, a task YAML's path, or an lm-eval registry name."""
    kind: str
    """heldout, shipped, volume (a task YAML on the volume), cached (registry, data in the eval cache) or hub
    (registry, data fetched by lm-eval from a reachable hub)."""
    label: str
    """The task's name in metric names (``<label>.<metric>``): the YAML's ``task:`` for a task file."""
    metrics: tuple[str, ...] = ()
    """The metrics it reports (() = not known before it runs: a hub task)."""
    source: str = ""
    """The task YAML (shipped, volume)."""
    version: str = ""
    """The task's version (its YAML's ``metadata.version``; for a group its tasks', joined)."""
    data_hash: str = ""
    """SHA-256 over its data (files, or the cached splits' digests); '' when not known before it runs."""
    size: int = 0
    """Documents in its test split(s) (0 = not known before it runs)."""


@dataclass(frozen=True)
class Guard:
    """A metric the adapter may not lose to the base by more than ``tolerance`` (promote_guards)."""

    metric: str
    tolerance: float


@dataclass(frozen=True)
class EvalPlan:
    """What the evaluate step scores besides perplexity (llmft/components/lib/evaluation/task_eval.py)."""

    tasks: tuple[str, ...] = ()
    """Task labels in order (heldout, shipped and volume tasks, lm-eval registry names), checked by the plan step."""
    questions: str = ""
    """JSONL file of question/answer rows for heldout; '' = the validation split."""
    max_questions: int = 16
    specs: tuple[EvalTaskPlan, ...] = ()
    """Each task as the plan step resolved it (same order as ``tasks``)."""
    cache_dir: str = ""
    """The offline lm-eval data cache on the volume (``<data_root>/eval-cache``)."""
    num_fewshot: int = -1
    """Few-shot examples per lm-eval question (-1 = each task's own default)."""
    limit: int = 0
    """lm-eval documents per task at most (0 = all)."""
    batch_size: int = 8
    """lm-eval's batch size (requests per forward pass)."""
    guards: tuple[Guard, ...] = ()
    """Metrics the adapter may not lose by more than their tolerance (the promote gate)."""
    max_new_tokens: int = 128
    """New tokens per held-out answer."""
    generation_timeout_s: int = 600
    """Wall-clock bound of one batch of held-out answers."""


@dataclass(frozen=True)
class ServingPlan:
    """Inputs of the InferenceService."""

    deploy: bool
    mode: str
    name: str
    namespace: str
    gpus: int
    resources: Resources
    runtime: str
    max_lora_rank: int
    timeout_s: int
    node_selector: dict[str, str]
    pvc_name: str
    hf_secret: SecretMount | None
    deploy_policy: str = "champion"
    """DEPLOY_POLICIES: whether a version that lost against the champion is deployed."""
    serving_mode: str = "auto"
    """SERVING_MODES: serve the adapter as a LoRA module, or merged into its base (the serving-form step decides)."""
    merged_dir: str = ""
    """Where the serving-form step writes the merged model (``<root>/merged/<registered name>/<run>``)."""
    form_note: str = ""
    """Why the plan already knows the adapter will be served merged (serving_mode=auto: DoRA, a rank above
    max_lora_rank); '' = decided after promotion."""
    prompts: tuple[str, ...] = ()
    """What the deploy step's check asks base and adapter (``serving_prompts``); () = DEFAULT_PROMPTS."""


@dataclass(frozen=True)
class RunPlan:
    """Everything a run does, resolved once by the plan step."""

    schema_version: int
    pipeline: str
    run_id: str
    on_cluster: bool
    """True when the plan step ran in a KFP task pod, False under kfp.local."""
    layout: DataLayout
    images: Images
    data: DataPlan
    trainer: TrainerPlan
    job: JobPlan
    registry: RegistryPlan
    serving: ServingPlan
    sweep: SweepPlan | None = None
    evaluation: EvalPlan = field(default_factory=EvalPlan)
    task_secrets: tuple[SecretMount, ...] = ()
    """The Secrets the compiled pipeline mounts into its own tasks."""
    task_resources: dict[str, Resources] = field(default_factory=dict)
    """CPU and memory of the KFP tasks by group (step, data, eval), applied by the compiled pipeline."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """The pipeline parameters as given (for the record)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunPlan:
        data = json.loads(text)
        version = data.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise ConfigError(
                f"plan.json has schema version {version}, this code reads {PLAN_SCHEMA_VERSION}: "
                "the plan was written by another release; re-run the pipeline with one image version"
            )
        return _from_data(cls, data)


def _from_data(tp: Any, value: Any) -> Any:
    """Rebuild a value of type ``tp`` (dataclass, tuple[X, ...], X | None, dict, scalar) from JSON data."""
    if value is None:
        return None
    if tp is TrainConfig:  # the trainer's own typed reader
        return config_from_dict(value, "plan.json trainer.config")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        return tp(
            **{f.name: _from_data(hints[f.name], value[f.name]) for f in dataclasses.fields(tp) if f.name in value}
        )
    if origin is tuple:
        return tuple(_from_data(args[0], v) for v in value)
    if origin is dict:
        return {k: _from_data(args[1], v) for k, v in value.items()}
    if args and type(None) in args:  # X | None
        return _from_data(next(a for a in args if a is not type(None)), value)
    return value


def write_plan(plan: RunPlan, directory: str | Path) -> Path:
    """``<directory>/plan.json`` (the plan artifact's folder)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PLAN_FILE
    tmp = path.with_name(f".{PLAN_FILE}.tmp")
    tmp.write_text(plan.to_json() + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_plan(directory: str | Path) -> RunPlan:
    """The plan a plan artifact holds."""
    path = Path(directory) / PLAN_FILE
    if not path.is_file():
        raise ConfigError(f"{path} is missing: the plan step did not finish")
    return RunPlan.from_json(path.read_text(encoding="utf-8"))
