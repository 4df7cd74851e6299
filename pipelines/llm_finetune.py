"""`llm_finetune_pipeline`: raw dataset -> validated JSONL -> packed shards -> fine-tune ->
evaluate -> promote -> register in MLflow -> deploy to KServe vLLM.

Every step is one component of ``components/`` (thin; the logic lives in the package). The
platform settings are applied here, once:

* the data/checkpoint PVC (``pvc_name``) is mounted at ``/data`` in every step
  (``kfp.kubernetes.mount_pvc``); the PyTorchJob replicas mount it at the same path;
* credentials come only from Kubernetes Secrets as environment variables
  (``kfp.kubernetes.use_secret_as_env``, all optional): the HF token where models or data
  are loaded, MLflow credentials where MLflow is written, Langfuse keys for training;
* the GPU step (evaluate) requests a GPU and gets a GPU node selector and toleration; the
  PyTorchJob's replicas get theirs from the train step;
* the train step has a timeout and retries (it resumes from the newest checkpoint).

No pipeline parameter is a secret. ``llmft pipeline compile`` writes the YAML;
``llmft pipeline run-local`` runs it here through kfp.local.
"""

# No `from __future__ import annotations`: KFP reads the real parameter annotations.
from kfp import dsl, kubernetes
from llmft.components.deploy import deploy_adapter
from llmft.components.evaluate import evaluate_perplexity
from llmft.components.lib.params import DATA_MOUNT
from llmft.components.prepare_dataset import prepare_dataset
from llmft.components.promote import promote_best_checkpoint
from llmft.components.register import register_model
from llmft.components.tokenize_dataset import tokenize_dataset
from llmft.components.train import train_model

PIPELINE_NAME = "llm-finetune"
TASK_ORDER = (
    "prepare-dataset",
    "tokenize-dataset",
    "train-model",
    "evaluate-perplexity",
    "promote-best-checkpoint",
    "register-model",
    "deploy-adapter",
)
"""The seven tasks, in the order they run."""

GPU_NODE_SELECTOR = ("nvidia.com/gpu.present", "true")
"""Label NVIDIA GPU feature discovery sets on GPU nodes."""
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
"""GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule."""
GPU_STEPS = ("evaluate-perplexity",)
"""Tasks that run model forward passes on a GPU in their own pod."""

TRAIN_TASK_TIMEOUT_S = 3 * 24 * 3600
"""kfp.kubernetes.set_timeout of the train task (longer than the job's own wait, job_timeout_s)."""
TRAIN_RETRIES = 2
"""Retries of the train task; each resumes from the newest complete checkpoint."""

SECRET_HF = "hf"
SECRET_MLFLOW = "mlflow"
SECRET_LANGFUSE = "langfuse"
STEP_SECRETS = {
    "prepare-dataset": (SECRET_HF,),
    "tokenize-dataset": (SECRET_HF,),
    "train-model": (SECRET_HF, SECRET_MLFLOW, SECRET_LANGFUSE),
    "evaluate-perplexity": (SECRET_HF,),
    "register-model": (SECRET_MLFLOW,),
    "deploy-adapter": (SECRET_HF,),
}
"""Which credential groups each step sees (promote needs none)."""


def secret_groups() -> dict[str, dict[str, dict[str, str]]]:
    """group -> {secret name: {key: env var}}, from the one list the PyTorchJob uses too."""
    from llmft.components.lib.pytorchjob import DEFAULT_SECRET_ENVS

    groups: dict[str, dict[str, dict[str, str]]] = {SECRET_HF: {}, SECRET_MLFLOW: {}, SECRET_LANGFUSE: {}}
    for item in DEFAULT_SECRET_ENVS:
        group = next(g for g in groups if item.env_name.lower().startswith(g))
        groups[group].setdefault(item.secret_name, {})[item.key] = item.env_name
    return groups


def apply_platform(
    task: dsl.PipelineTask, step: str, pvc_name, *, secrets: tuple[str, ...] | None = None, gpu: bool | None = None
) -> dsl.PipelineTask:
    """Mount the PVC at /data, inject the step's Secrets (optional keys), and place GPU steps
    on GPU nodes. ``secrets`` / ``gpu`` default to STEP_SECRETS / GPU_STEPS for ``step``;
    other pipelines (the HPO one) pass them for their own steps."""
    kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=DATA_MOUNT)
    groups = secret_groups()
    for group in STEP_SECRETS.get(step, ()) if secrets is None else secrets:
        for secret_name, key_to_env in groups[group].items():
            kubernetes.use_secret_as_env(task, secret_name=secret_name, secret_key_to_env=key_to_env, optional=True)
    if (step in GPU_STEPS) if gpu is None else gpu:
        task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
        kubernetes.add_node_selector(task, *GPU_NODE_SELECTOR)
        kubernetes.add_toleration(task, **GPU_TOLERATION)
    task.set_caching_options(False)  # our own content-addressed caches decide reuse
    return task


def call_component(component, params: dict, **explicit) -> dsl.PipelineTask:
    """Call ``component``, taking each input it declares from ``explicit`` or else from the
    pipeline parameter of the same name in ``params`` (every input is named after one)."""
    names = component.component_spec.inputs or {}
    args = {name: params[name] for name in names if name in params and name not in explicit}
    return component(**args, **explicit)


def add_data_steps(params: dict) -> tuple[dsl.PipelineTask, dsl.PipelineTask]:
    """prepare (validates every input, fails fast on bad data) -> tokenize onto the PVC."""
    prepare = call_component(prepare_dataset, params)
    apply_platform(prepare.set_display_name("prepare dataset"), "prepare-dataset", params["pvc_name"])
    tokenize = call_component(tokenize_dataset, params, prepared=prepare.outputs["prepared"])
    apply_platform(tokenize.set_display_name("tokenize to PVC"), "tokenize-dataset", params["pvc_name"])
    return prepare, tokenize


def add_train_step(
    params: dict, tokenize: dsl.PipelineTask, *, display_name: str = "train", **explicit
) -> dsl.PipelineTask:
    """The train step, with its timeout and retries (each retry resumes from the newest checkpoint)."""
    train = call_component(train_model, params, tokenized=tokenize.outputs["tokenized"], **explicit)
    apply_platform(train.set_display_name(display_name), "train-model", params["pvc_name"])
    train.set_retry(num_retries=TRAIN_RETRIES, backoff_duration="60s", backoff_factor=2.0)
    kubernetes.set_timeout(train, TRAIN_TASK_TIMEOUT_S)
    return train


def add_release_steps(params: dict, tokenize: dsl.PipelineTask, train: dsl.PipelineTask) -> None:
    """evaluate -> promote -> register in MLflow -> deploy to KServe vLLM."""
    pvc = params["pvc_name"]
    evaluate = call_component(
        evaluate_perplexity, params, tokenized=tokenize.outputs["tokenized"], run=train.outputs["run"]
    )
    apply_platform(evaluate.set_display_name("evaluate perplexity"), "evaluate-perplexity", pvc)

    promote = call_component(promote_best_checkpoint, params, evaluation=evaluate.outputs["evaluation"])
    apply_platform(promote.set_display_name("promote best checkpoint"), "promote-best-checkpoint", pvc)

    register = call_component(
        register_model,
        params,
        promoted=promote.outputs["promoted"],
        evaluation=evaluate.outputs["evaluation"],
        run=train.outputs["run"],
        tokenized=tokenize.outputs["tokenized"],
        task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
    )
    apply_platform(register.set_display_name("register in MLflow"), "register-model", pvc)
    register.set_retry(num_retries=2, backoff_duration="30s")  # idempotent: a retry reuses the version

    deploy_task = call_component(
        deploy_adapter, params, promoted=promote.outputs["promoted"], registration=register.outputs["registration"]
    )
    apply_platform(deploy_task.set_display_name("deploy to KServe vLLM"), "deploy-adapter", pvc)


@dsl.pipeline(name=PIPELINE_NAME, description="Fine-tune an LLM adapter on Kubeflow and serve it with KServe + vLLM")
def llm_finetune_pipeline(
    model: str = "Qwen/Qwen2.5-7B-Instruct",
    dataset: str = "tatsu-lab/alpaca",
    dataset_format: str = "auto",
    dataset_split: str = "train",
    val_fraction: float = 0.05,
    max_reject_fraction: float = 0.01,
    max_length: int = 2048,
    packing: bool = True,
    method: str = "lora",
    lora_r: int = 16,
    lora_alpha: float = 32.0,
    lora_dropout: float = 0.05,
    lora_target_modules: str = "all-linear",
    learning_rate: float = 2e-4,
    epochs: float = 1.0,
    max_steps: int = 0,
    seed: int = 42,
    train_overrides: str = "",
    training_backend: str = "kubeflow",
    num_workers: int = 1,
    gpus_per_worker: int = 1,
    job_timeout_s: int = 2 * 24 * 3600,
    pvc_name: str = "llmft-data",
    data_root: str = DATA_MOUNT,
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "llm-finetune",
    mlflow_model_name: str = "llm-adapter",
    promote_margin: float = 0.01,
    deploy: bool = True,
    deploy_mode: str = "kserve",
    serving_name: str = "llm-adapter",
    serving_namespace: str = "",
    serving_gpus: int = 1,
    max_lora_rank: int = 64,
    deploy_timeout_s: int = 1800,
):
    """Parameters (none is a secret; credentials come from Kubernetes Secrets):

    model: base model, hub id or directory. dataset / dataset_format / dataset_split: the raw
    data (hub id or a path on the volume) and how to read it. val_fraction,
    max_reject_fraction: split and tolerated bad rows. max_length, packing: tokenization.
    method, lora_*: lora | qlora | full and the adapter shape. learning_rate, epochs or
    max_steps (> 0 wins), seed, train_overrides ("key=value ..." for any other trainer
    setting). training_backend: kubeflow (PyTorchJob) | local (torchrun in the step).
    num_workers, gpus_per_worker: PyTorchJob size. pvc_name: the RWX data/checkpoint PVC;
    data_root: where it is mounted (keep /data on a cluster). mlflow_*: tracking URI (empty =
    from the mlflow Secret), experiment and registered model name. promote_margin: relative
    perplexity gain over the base model required to promote. deploy, deploy_mode (kserve |
    local), serving_*: the InferenceService; max_lora_rank: the vLLM runtime's limit.
    """
    params = {**locals(), "run_id": dsl.PIPELINE_JOB_ID_PLACEHOLDER}
    _prepare, tokenize = add_data_steps(params)
    train = add_train_step(params, tokenize)
    add_release_steps(params, tokenize, train)


def compile_pipeline(output: str) -> str:
    """Compile ``llm_finetune_pipeline`` to ``output`` (YAML) and return the path."""
    from kfp import compiler

    compiler.Compiler().compile(llm_finetune_pipeline, package_path=output)
    return output
