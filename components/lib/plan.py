"""The run plan: every pipeline parameter resolved and checked once, written as ``plan.json``.

The first task of both pipelines (``plan-run``, components/plan.py) hands its parameters to
:func:`build_plan`, which checks them all (before any GPU is requested) and returns a
:class:`RunPlan`: a typed tree that every later task reads back with :func:`read_plan`.
Nothing after the plan takes a knob; each task takes the plan plus its data artifacts.

A knob's whole route, e.g. ``lora_r``::

    components/plan.py          plan_run(..., lora_r: int = 16, ...)   signature + docstring (the
                                                                       pipelines' parameter list)
    components/lib/plan.py      f"lora.r={p.lora_r}"                   -> TrainerPlan.overrides
    components/train.py         plan.trainer.command_overrides(data)   -> the trainer's key=value list

Parameters that the compiled YAML applies to the KFP tasks themselves (the Secrets the tasks
mount, the evaluate task's GPU node selector) are fixed when the pipeline is compiled: KFP
backends before 2.5 cannot take a Secret or node-selector value from a parameter
(backend/src/v2/driver/driver.go at 2.4.0 reads only the static ``secretName`` and ``labels``).
The pipeline passes the compiled values in ``compiled``; on a cluster the plan refuses a run
whose value differs, naming the recompile command.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmft.components.lib.trainjob import DEFAULT_RUNTIME
from llmft.trainer.errors import ConfigError

PLAN_SCHEMA_VERSION = 1
"""Version of plan.json's layout; :func:`read_plan` refuses any other."""
PLAN_FILE = "plan.json"
DATA_MOUNT = "/data"
"""Where the data/checkpoint PVC is mounted in every pipeline pod and job replica."""
TRAINING_BACKENDS = ("kubeflow", "trainjob", "local")
"""kubeflow: a PyTorchJob (Training Operator v1); trainjob: a TrainJob (Kubeflow Trainer v2); local: kfp.local."""
DEPLOY_MODES = ("kserve", "local", "vllm")
"""kserve: an InferenceService on the cluster; local: a transformers generation check (kfp.local); vllm: a real
vLLM OpenAI server on this machine with the manifest's arguments and the smoke test (kfp.local,
``make serving-venv``)."""
SERVING_MODES = ("auto", "lora", "merged")
"""auto: the adapter as a vLLM LoRA module when vLLM can serve it, else merged into its base (the reason
logged); lora: LoRA only (an adapter vLLM refuses fails the run); merged: always the merged model
(components/lib/serving_form.py)."""
SWEEP_BACKENDS = ("katib", "local")
PIPELINE_OWNED_KEYS = ("model.name_or_path", "data", "output_dir", "method", "resume")
"""Trainer keys the plan sets itself; ``train_overrides`` may not change them."""
SWEEP_PREFIX = "sweep_"
"""Parameters named ``sweep_*`` belong to the HPO pipeline only (the plain one leaves their defaults)."""
COMPILED_PARAMETERS = ("hf_token_secret", "mlflow_secret", "langfuse_secret", "gpu_node_selector")
"""Parameters the compiled YAML applies to the KFP tasks themselves: fixed at compile time."""
TRAIN_TASK_TIMEOUT_S = 3 * 24 * 3600
"""kfp.kubernetes.set_timeout of the train task: the job's own deadline (``job_timeout_s``) must end first."""
SWEEP_TASK_TIMEOUT_S = 4 * 24 * 3600
"""kfp.kubernetes.set_timeout of the sweep task: longer than its own wait (``sweep_timeout_s``)."""
DEPLOY_POLICIES = ("champion", "always")
"""champion: deploy only a version that became (or stayed) the registry's champion; always: deploy it anyway."""
KFP_POD_ENV = "KFP_POD_NAME"
"""Set by the KFP backend in every task container (backend/src/v2/compiler/argocompiler/common.go
``commonEnvs``, 2.4.0 onwards); never by kfp.local, even when kfp.local runs inside a pod."""


# --- the plan's dataclasses -------------------------------------------------------------------


@dataclass(frozen=True)
class DataLayout:
    """Folders on the shared volume (the PVC on a cluster; a local folder for run-local).

    ``<root>/hf-cache`` HF_HOME; ``datasets/<run>`` prepared JSONL; ``tokenized/<cache key>``
    packed shards, reused by any run with the same key; ``runs/<run>`` checkpoints and
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
    """hf, mlflow or langfuse (SECRET_KINDS)."""
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


@dataclass(frozen=True)
class TrainerPlan:
    """The trainer's command line, minus the tokenized data the tokenize step finds."""

    model: str
    method: str
    run_dir: str
    """output_dir of the run: stable across retries, so a retry resumes."""
    overrides: tuple[str, ...]
    """``key=value`` overrides (the pipeline's, then ``train_overrides``)."""
    user_overrides: tuple[str, ...] = ()
    """The ``train_overrides`` part alone (the sweep warns when its best values replace one)."""
    revision: str | None = None
    """``model.revision`` of the overrides: the tokenize step reads the tokenizer the trainer loads."""

    def command_overrides(self, data_dir: str, extra: typing.Sequence[str] = ()) -> list[str]:
        """The full list for the trainer: the plan's, ``data=``, then ``extra`` (a sweep's best, which win)."""
        return [*self.overrides, f"data={data_dir}", *extra]


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


def on_kfp_cluster(environ: Mapping[str, str] | None = None) -> bool:
    """True inside a KFP task pod on a cluster, False under kfp.local (see KFP_POD_ENV)."""
    return bool((os.environ if environ is None else environ).get(KFP_POD_ENV))


# --- the builder ------------------------------------------------------------------------------


class Parameters:
    """The pipeline parameters, read as attributes; remembers which were read (a test checks that
    the builder reads every parameter of the signature)."""

    def __init__(self, values: Mapping[str, Any]):
        self._values = dict(values)
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            value = self._values[name]
        except KeyError:
            raise ConfigError(f"pipeline parameter `{name}` is missing from the plan step's inputs") from None
        self.read.add(name)
        return value

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)


def build_plan(
    values: Mapping[str, Any] | Parameters,
    *,
    run_id: str,
    compiled: str = "",
    environ: Mapping[str, str] | None = None,
) -> RunPlan:
    """Check every parameter and resolve the run; raises ConfigError naming the first bad one.

    ``compiled`` is the JSON the pipeline passes (its name and the COMPILED_PARAMETERS values);
    ``environ`` (default os.environ) tells a cluster task from kfp.local."""
    from llmft.components.lib import plan_checks as checks

    p = values if isinstance(values, Parameters) else Parameters(values)
    settings = json.loads(compiled) if compiled else {}
    on_cluster = on_kfp_cluster(environ)
    layout = DataLayout(p.data_root)
    run_id = checks.check_run_id(run_id)
    checks.check_general(p, on_cluster)
    if on_cluster:
        checks.check_compiled(p, settings)
    images = Images(
        trainer=checks.check_image(p.trainer_image), serving_runtime=checks.check_runtime(p.serving_runtime)
    )
    secrets = {kind: checks.parse_secret(kind, getattr(p, param)) for kind, param in checks.SECRET_PARAMETERS.items()}
    trainer = trainer_plan(p, layout, run_id)
    config = checks.check_training(trainer)
    pipeline = settings.get("pipeline", "llm-finetune")
    trials = tuple(shlex.split(p.sweep_trial_overrides or "")) if pipeline.endswith("-hpo") else ()
    checks.check_remote_code(config, settings, trials)
    plan = RunPlan(
        schema_version=PLAN_SCHEMA_VERSION,
        pipeline=pipeline,
        run_id=run_id,
        on_cluster=on_cluster,
        layout=layout,
        images=images,
        data=_data_plan(p, layout, run_id),
        trainer=trainer,
        job=job_plan(p, layout, run_id, images, secrets),
        registry=_registry_plan(p, layout, run_id, on_cluster, environ),
        serving=_serving_plan(p, layout, run_id, images, secrets),
        sweep=_sweep_plan(p, layout, run_id) if pipeline.endswith("-hpo") else None,
        task_secrets=tuple(s for s in (secrets["hf"], secrets["mlflow"], secrets["langfuse"]) if s is not None),
        task_resources=checks.task_resources(p),
        parameters=p.as_dict(),
    )
    form_note = checks.check_serving(plan, config)
    if form_note:
        plan = dataclasses.replace(plan, serving=dataclasses.replace(plan.serving, form_note=form_note))
    if plan.sweep is not None:
        checks.check_sweep(plan, p.max_lora_rank)
    from llmft.components.lib.volume_space import check_volume_space

    note = check_volume_space(plan, config, p.data_root)  # the run's checkpoints must fit the mounted volume
    if note:
        print(note, flush=True)
    return plan


def _data_plan(p: Parameters, layout: DataLayout, run_id: str) -> DataPlan:
    return DataPlan(
        dataset=p.dataset,
        format=p.dataset_format,
        split=p.dataset_split,
        val_fraction=p.val_fraction,
        max_reject_fraction=p.max_reject_fraction,
        seed=p.seed,
        max_length=p.max_length,
        packing=p.packing,
        prepared_dir=layout.prepared(run_id),
    )


def trainer_plan(p: Parameters, layout: DataLayout, run_id: str) -> TrainerPlan:
    """The only place pipeline parameters become trainer keys (``lora_r`` -> ``lora.r``)."""
    from llmft.components.lib.plan_checks import extra_override_list

    run_dir = layout.run_dir(run_id)
    overrides = [
        f"model.name_or_path={p.model}",
        f"output_dir={run_dir}",
        f"method={p.method}",
        f"lora.r={p.lora_r}",
        f"lora.alpha={p.lora_alpha}",
        f"lora.dropout={p.lora_dropout}",
        f"lora.target_modules={p.lora_target_modules}",
        f"optim.lr={p.learning_rate}",
        f"seed={p.seed}",
        "resume=auto",  # a retried task continues from the newest complete checkpoint
        f"observe.run_name=pipeline-{run_id}",
    ]
    overrides += [f"max_steps={p.max_steps}"] if p.max_steps > 0 else ["max_steps=0", f"epochs={p.epochs}"]
    if p.mlflow_experiment:
        overrides.append(f"observe.mlflow_experiment={p.mlflow_experiment}")
    user = extra_override_list(p.train_overrides, "train_overrides")
    revisions = [o.split("=", 1)[1] for o in user if o.startswith("model.revision=")]
    return TrainerPlan(
        model=p.model,
        method=p.method,
        run_dir=run_dir,
        overrides=(*overrides, *user),
        user_overrides=tuple(user),
        revision=(revisions[-1] or None) if revisions else None,
    )


def job_plan(p: Parameters, layout: DataLayout, run_id: str, images: Images, secrets: Mapping) -> JobPlan:
    """The training job's inputs (also the CLI's ``llmft sweep create``, from the same parameters)."""
    from llmft.components.lib.cleanup import RUN_ID_LABEL, run_label
    from llmft.components.lib.plan_checks import check_resources, parse_node_selector
    from llmft.components.lib.train_job import job_name

    env = layout.hf_env()
    job_secrets = [s for s in (secrets.get("hf"), secrets.get("mlflow"), secrets.get("langfuse")) if s is not None]
    if p.mlflow_tracking_uri:  # the parameter wins over the Secret's key
        env["MLFLOW_TRACKING_URI"] = p.mlflow_tracking_uri
        job_secrets = [_without_key(s, "MLFLOW_TRACKING_URI") for s in job_secrets]
    return JobPlan(
        backend=p.training_backend,
        name=job_name(run_id),
        num_workers=p.num_workers,
        gpus_per_worker=p.gpus_per_worker,
        resources=check_resources("worker", p.worker_cpu, p.worker_memory),
        node_selector=parse_node_selector(p.gpu_node_selector) if p.gpus_per_worker else {},
        timeout_s=_task_bounded("job_timeout_s", p.job_timeout_s, TRAIN_TASK_TIMEOUT_S),
        pvc_name=p.pvc_name,
        mount_path=layout.root,
        image=images.trainer,
        env=env,
        secrets=tuple(s for s in job_secrets if s.keys),
        labels={RUN_ID_LABEL: run_label(run_id)},
        runtime=_training_runtime(p.training_runtime),
    )


def _training_runtime(value: str) -> str:
    from llmft.components.lib.trainjob import parse_runtime_ref

    try:
        parse_runtime_ref(value)
    except ConfigError as exc:
        raise ConfigError(f"pipeline parameter `training_runtime`={value!r}: {exc}") from None
    return value


def _task_bounded(name: str, value: int, task_timeout_s: int) -> int:
    """A wait of ``value`` seconds that must end (plus the launcher's grace after a job's deadline)
    before the KFP task's own timeout, or the task pod would be killed while its job still runs."""
    from llmft.components.lib.train_job import JOB_WAIT_GRACE_S

    limit = task_timeout_s - JOB_WAIT_GRACE_S
    if not 0 < value <= limit:
        raise ConfigError(
            f"pipeline parameter `{name}`={value}: must be between 1 and {limit} seconds (the task's own timeout "
            f"{task_timeout_s} s minus {JOB_WAIT_GRACE_S} s), so the job ends before the step that waits for it"
        )
    return value


def _without_key(secret: SecretMount, key: str) -> SecretMount:
    return dataclasses.replace(secret, keys=tuple(k for k in secret.keys if k != key))


def _registry_plan(p: Parameters, layout: DataLayout, run_id: str, on_cluster: bool, environ) -> RegistryPlan:
    from llmft.components.lib.plan_checks import check_tracking

    check_tracking(p, on_cluster, os.environ if environ is None else environ)
    return RegistryPlan(
        tracking_uri=p.mlflow_tracking_uri,
        experiment=p.mlflow_experiment,
        model_name=p.mlflow_model_name,
        promote_margin=p.promote_margin,
        promoted_dir=layout.promoted(p.mlflow_model_name, run_id),
    )


def _serving_plan(p: Parameters, layout: DataLayout, run_id: str, images: Images, secrets: dict) -> ServingPlan:
    from llmft.components.lib.plan_checks import check_resources, parse_node_selector

    return ServingPlan(
        deploy=p.deploy,
        mode=p.deploy_mode,
        name=p.serving_name,
        namespace=p.serving_namespace,
        gpus=p.serving_gpus,
        resources=check_resources("serving", p.serving_cpu, p.serving_memory),
        runtime=images.serving_runtime,
        max_lora_rank=p.max_lora_rank,
        timeout_s=p.deploy_timeout_s,
        node_selector=parse_node_selector(p.gpu_node_selector) if p.serving_gpus else {},
        pvc_name=p.pvc_name,
        hf_secret=secrets["hf"],
        deploy_policy=_choice("deploy_policy", p.deploy_policy, DEPLOY_POLICIES),
        serving_mode=_choice("serving_mode", p.serving_mode, SERVING_MODES),
        merged_dir=layout.merged(p.mlflow_model_name, run_id),
        prompts=parse_prompts(p.serving_prompts),
    )


PROMPT_SEPARATOR = " | "


def parse_prompts(text: str) -> tuple[str, ...]:
    """``serving_prompts`` -> the prompts (blank ones dropped)."""
    return tuple(part.strip() for part in text.split(PROMPT_SEPARATOR.strip()) if part.strip())


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"pipeline parameter `{name}`={value!r}: choose one of {', '.join(choices)}")
    return value


def _sweep_plan(p: Parameters, layout: DataLayout, run_id: str) -> SweepPlan:
    from llmft.components.lib.sweep import DEFAULT_TRIAL_OVERRIDES, experiment_name

    name = experiment_name(run_id)
    settings = (
        f"algorithm={p.sweep_algorithm}",
        f"max_trials={p.sweep_max_trials}",
        f"parallel_trials={p.sweep_parallel_trials}",
        f"max_failed_trials={p.sweep_max_failed_trials}",
        *shlex.split(p.sweep_overrides or ""),
    )
    trials = tuple(shlex.split(p.sweep_trial_overrides or "")) or DEFAULT_TRIAL_OVERRIDES
    return SweepPlan(
        backend=p.sweep_backend,
        experiment=name,
        settings=settings,
        trial_overrides=trials,
        timeout_s=_task_bounded("sweep_timeout_s", p.sweep_timeout_s, SWEEP_TASK_TIMEOUT_S),
        workdir=layout.sweep_dir(name),
    )
