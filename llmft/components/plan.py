"""Step 0 of both pipelines: check every parameter and write the run plan (plan.json).

``plan_run``'s signature IS the pipelines' parameter list: names, types, defaults and (from its
docstring's Args) the descriptions the KFP UI shows. llmft/pipelines/llm_finetune.py derives both
pipelines' signatures from it (parameters named ``sweep_*`` only in the HPO pipeline). Adding a
knob = a parameter here (with its Args line), the same field in llmft/components/lib/plan/parameters.py
(PipelineParameters, the typed value the builder reads; a test holds the two equal) and its use in
llmft/components/lib/plan/build.py.
"""
# No `from __future__ import annotations` in component modules: KFP reads the real annotation objects.
# Defaults are literals: KFP ships this function's source into the container, where module
# names are not defined. '' for trainer_image / serving_runtime = the value compiled into the
# pipeline (COMPILE_TIME_DEFAULTS below; llmft/components/images.py and its LLMFT_* variables).

import inspect

from kfp import dsl
from kfp.dsl import Artifact, Output

from llmft.components import images
from llmft.components.images import PIPELINE_IMAGE


@dsl.component(base_image=PIPELINE_IMAGE, install_kfp_package=False)
def plan_run(
    plan: Output[Artifact],
    model: str = "Qwen/Qwen2.5-7B-Instruct",
    dataset: str = "tatsu-lab/alpaca",
    dataset_format: str = "auto",
    dataset_split: str = "train",
    dataset_config: str = "",
    dataset_columns: str = "",
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
    sweep_backend: str = "katib",
    sweep_algorithm: str = "tpe",
    sweep_max_trials: int = 12,
    sweep_parallel_trials: int = 3,
    sweep_max_failed_trials: int = 3,
    sweep_overrides: str = "",
    sweep_trial_overrides: str = "",
    sweep_timeout_s: int = 3 * 24 * 3600,
    training_backend: str = "kubeflow",
    training_runtime: str = "torch-distributed",
    num_workers: int = 1,
    gpus_per_worker: int = 1,
    worker_cpu: str = "8",
    worker_memory: str = "64Gi",
    gpu_node_selector: str = "",
    job_timeout_s: int = 24 * 3600,
    trainer_image: str = "",
    pvc_name: str = "llmft-data",
    data_root: str = "/data",
    hf_token_secret: str = "",
    mlflow_secret: str = "",
    langfuse_secret: str = "",
    s3_secret: str = "",
    step_cpu: str = "1",
    step_memory: str = "2Gi",
    data_cpu: str = "4",
    data_memory: str = "16Gi",
    eval_cpu: str = "8",
    eval_memory: str = "64Gi",
    mlflow_tracking_uri: str = "",
    mlflow_experiment: str = "llm-finetune",
    mlflow_model_name: str = "llm-adapter",
    promote_margin: float = 0.01,
    promote_metric: str = "perplexity",
    eval_tasks: str = "heldout",
    eval_questions: str = "",
    eval_max_questions: int = 16,
    eval_guards: str = "",
    eval_num_fewshot: int = -1,
    eval_limit: int = 500,
    eval_batch_size: int = 8,
    deploy: bool = True,
    deploy_mode: str = "kserve",
    deploy_policy: str = "champion",
    serving_mode: str = "auto",
    serving_name: str = "llm-adapter",
    serving_namespace: str = "",
    serving_gpus: int = 1,
    serving_cpu: str = "4",
    serving_memory: str = "32Gi",
    serving_runtime: str = "",
    max_lora_rank: int = 64,
    serving_prompts: str = "",
    deploy_timeout_s: int = 1800,
    run_id: str = "",
    compiled: str = "",
):
    """Check every parameter, then write plan.json: what each later step does.

    None of the parameters is a secret: credentials come from the Kubernetes Secrets named by
    hf_token_secret, mlflow_secret, langfuse_secret and s3_secret.

    Args:
        model: Base model: a Hugging Face hub id or a directory on the volume.
        dataset: Raw data: a hub dataset id, a file/folder on the volume, https://host/file.jsonl (.json, .csv,
            .parquet), or s3://bucket/key.jsonl or s3://bucket/prefix/ (credentials: s3_secret).
        dataset_format: auto, messages (OpenAI chat), sharegpt, alpaca, prompt_completion or text.
        dataset_split: Split of a hub dataset to read.
        dataset_config: Configuration (subset) of a hub dataset ('' = its default).
        dataset_columns: The rows' columns as a format's fields, field:column pairs, e.g.
            "prompt:question,completion:answer" ('' = the columns carry the fields' names).
        val_fraction: Fraction of accepted rows held out for validation (0 < f < 1).
        max_reject_fraction: Fail the prepare step when more rows than this fraction are rejected.
        max_length: Tokens per packed training sequence.
        packing: Pack several conversations into each sequence (attention never crosses them).
        method: lora, qlora or full.
        lora_r: LoRA rank (above max_lora_rank the adapter is served merged; serving_mode=lora refuses it).
        lora_alpha: LoRA alpha (scale = alpha / r).
        lora_dropout: LoRA dropout.
        lora_target_modules: Comma-separated module names, or all-linear.
        learning_rate: Peak learning rate.
        epochs: Passes over the training split (when max_steps is 0).
        max_steps: Optimizer steps; > 0 wins over epochs.
        seed: Seed of the data split and order, LoRA init and dropout.
        train_overrides: More trainer settings as key=value pairs, e.g. "save_every=200 eval_every=100".
        sweep_backend: katib (a Katib Experiment of PyTorchJob trials) or local (Optuna under kfp.local only).
        sweep_algorithm: random, tpe, grid or bayesianoptimization.
        sweep_max_trials: Trials in total.
        sweep_parallel_trials: Trials at once.
        sweep_max_failed_trials: Failed trials tolerated before the sweep fails.
        sweep_overrides: More sweep settings as key=value, e.g. "space.lora_r.values=8,16 early_stopping=false".
        sweep_trial_overrides: Fixed trainer settings of every trial ('' = max_steps=200 eval_every=25 ...).
        sweep_timeout_s: How long the sweep step waits for the Experiment.
        training_backend: kubeflow (a PyTorchJob), trainjob (a Kubeflow Trainer v2 TrainJob) or local (subprocesses
            of the step, kfp.local only). The sweep's trials run on the same kind of job.
        training_runtime: The runtime a trainjob references: NAME of a ClusterTrainingRuntime (default: the
            torch-distributed one Kubeflow Trainer ships) or TrainingRuntime/NAME in the run's namespace.
        num_workers: PyTorchJob pods: one Master plus num_workers - 1 Workers.
        gpus_per_worker: GPUs per pod (one trainer process per GPU).
        worker_cpu: CPU request and limit of each training pod (and Katib trial).
        worker_memory: Memory request and limit of each training pod, including the 8Gi /dev/shm.
        gpu_node_selector: label=value[,label=value] the GPU pods must match ('' = none; the GPU request places
            them). Fixed when compiling (the evaluate task applies it).
        job_timeout_s: The job's activeDeadlineSeconds, and how long the train step waits for it (default one
            day: a stuck job holds its GPUs no longer; raise it for longer runs, up to the task's 3-day timeout).
        trainer_image: Image of the training pods and Katib trials (default: the one compiled in).
        pvc_name: The ReadWriteMany data/checkpoint PVC.
        data_root: Where the PVC is mounted (keep /data on a cluster).
        hf_token_secret: Secret with the key HF_TOKEN for gated models/data ('' = none). NAME or NAME:KEY,...
            Fixed when compiling (prepare, tokenize and evaluate mount it).
        mlflow_secret: Secret with MLflow keys, NAME (key MLFLOW_TRACKING_URI) or NAME:KEY,... from
            MLFLOW_TRACKING_URI, _USERNAME, _PASSWORD, _TOKEN ('' = none). Fixed when compiling (register mounts it).
        langfuse_secret: Secret with LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_HOST for the trainer's
            traces ('' = none). NAME or NAME:KEY,...
        s3_secret: Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for an s3:// dataset ('' = none, or the
            pod's IAM role). NAME or NAME:KEY,... adding AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL (MinIO, Ceph).
            Fixed when compiling (prepare mounts it).
        step_cpu: CPU request and limit of the light steps (plan, train and sweep launchers, promote, register, deploy).
        step_memory: Memory request and limit of the light steps.
        data_cpu: CPU request and limit of prepare, tokenize and the serving-form step (which merges an adapter).
        data_memory: Memory request and limit of prepare, tokenize and the serving-form step.
        eval_cpu: CPU request and limit of the evaluate step (1 GPU).
        eval_memory: Memory request and limit of the evaluate step (loads the base model).
        mlflow_tracking_uri: MLflow server ('' = MLFLOW_TRACKING_URI from mlflow_secret).
        mlflow_experiment: MLflow experiment of the training runs and the registration.
        mlflow_model_name: Registered model name (also the promoted adapter's folder name).
        promote_margin: Gain over the base model required to promote: relative for perplexity (0.01 = 1% lower),
            absolute points for a task score (0.01 = one point higher).
        promote_metric: What the promote gate, the best checkpoint and the registry's champion follow: perplexity or
            a metric of a task in eval_tasks, e.g. heldout.contains, heldout.exact_match, heldout.token_f1,
            arc_easy.acc.
        eval_tasks: Tasks the evaluate step scores base and checkpoints on, comma-separated: heldout (greedy
            answers to held-out questions: SQuAD exact match and token F1, whole-word contains), velmora_mc (shipped),
            any lm-eval task, group or tag (arc_easy, mmlu_abstract_algebra, hellaswag; data from
            <data_root>/eval-cache, filled by `llmft eval cache`, or a reachable hub) and task YAMLs on the volume
            (/data/tasks/t.yaml); '' = perplexity only.
        eval_questions: JSONL file on the volume of {"question": ..., "answer": ... or [...]} for heldout ('' =
            the validation split's conversations, the last assistant turn as the reference).
        eval_max_questions: Held-out questions per model (at most; bounds the evaluate step's generation time).
        eval_guards: Metrics the adapter may not lose to the base, comma-separated metric[:tolerance], e.g.
            "arc_easy.acc:0.02" (two points; default 0.01) or "perplexity:0.05" (5%); '' = none.
        eval_num_fewshot: Few-shot examples per lm-eval question (-1 = each task's own default, usually 0).
        eval_limit: lm-eval documents per task and model at most (0 = all): bounds the evaluate step's time.
        eval_batch_size: lm-eval requests per forward pass.
        deploy: Apply the InferenceService (false: write and validate its manifest only).
        deploy_mode: kserve, local (a generation check with transformers, kfp.local only) or vllm (a real vLLM
            server on this machine with the manifest's arguments, and the smoke test; kfp.local only, make
            serving-venv).
        deploy_policy: champion (deploy only a version the registry made its champion; one that lost is registered,
            not served) or always.
        serving_mode: auto (the adapter as a vLLM LoRA module when vLLM can serve it, else merged into its base, the
            reason logged), lora (LoRA only: an adapter vLLM refuses fails the run) or merged (always merged: a full
            copy of the weights on the volume, served without --enable-lora).
        serving_name: InferenceService name (at most 45 characters).
        serving_namespace: Namespace of the InferenceService ('' = the pipeline's).
        serving_gpus: GPUs of the predictor.
        serving_cpu: CPU request and limit of the predictor.
        serving_memory: Memory request and limit of the predictor.
        serving_runtime: KServe (Cluster)ServingRuntime (default: the one compiled in).
        max_lora_rank: vLLM --max-lora-rank of the runtime (8, 16, 32, 64, 128, 256, 320 or 512).
        serving_prompts: Prompts, separated by ' | ', that the deploy step's check puts to base and adapter
            (the first one in the endpoint smoke test); '' = two general questions.
        deploy_timeout_s: How long the deploy step waits for the InferenceService to be Ready.
        run_id: (set by the pipeline) the KFP run id.
        compiled: (set by the pipeline) its name and the values its tasks were compiled with.

    Outputs: ``plan`` (plan.json, read by every later step) and, on the volume, the trainer's resolved
    config ``<data_root>/runs/<run_id>/config.yaml`` (the training job runs ``llmft train --config`` it).
    """
    values = dict(locals())  # first statement: exactly the parameters, handed to the plan builder by name
    from llmft.components.lib.jobs.trainjob_runtime import preflight_runtime
    from llmft.components.lib.plan.build import build_plan, write_run_config
    from llmft.components.lib.plan.checks import check_runs_here, preflight_secrets, preflight_serving_namespace
    from llmft.components.lib.plan.schema import write_plan
    from llmft.components.lib.plan.volume_access import check_volume_writable

    for name in ("plan", "run_id", "compiled"):
        values.pop(name)
    run_plan = build_plan(values, run_id=run_id, compiled=compiled)
    if run_plan.on_cluster:
        for note in preflight_secrets(run_plan):
            print(f"WARNING: {note}")
        preflight_serving_namespace(run_plan)
        preflight_runtime(run_plan)
        check_volume_writable(run_plan.layout)
    else:
        check_runs_here(run_plan)  # a cluster-only backend: refused here, before prepare and tokenize
        print("kfp.local: Secret preflight skipped (credentials come from this environment)")
    write_run_config(run_plan)  # the trainer's resolved config on the volume, before the plan is handed on
    write_plan(run_plan, plan.path)
    plan.metadata.update({"schema_version": run_plan.schema_version, "run_id": run_plan.run_id})
    plan.metadata.update({"trainer_image": run_plan.images.trainer, "job": run_plan.job.name})
    print(f"plan: {run_plan.pipeline} run {run_plan.run_id}; trainer image {run_plan.images.trainer}")
    print(f"trainer config: {run_plan.trainer.config_path} (llmft train --config; data= after tokenize)")
    if run_plan.serving.form_note:
        print(f"serving form: merged ({run_plan.serving.form_note})")


INTERNAL_INPUTS = ("plan", "run_id", "compiled")
"""Inputs of plan_run that are not pipeline parameters."""


def compile_time_defaults() -> dict:
    """Defaults taken from where the pipeline is compiled (llmft/components/images.py reads LLMFT_* at import)."""

    return {"trainer_image": images.TRAINER_IMAGE, "serving_runtime": images.SERVING_RUNTIME}


def parameter_defaults(*, hpo: bool = True) -> dict:
    """name -> default of every pipeline parameter (with the compile-time defaults filled in)."""

    signature = inspect.signature(plan_run.python_func)
    values = {n: p.default for n, p in signature.parameters.items() if n not in INTERNAL_INPUTS}
    if not hpo:
        values = {n: v for n, v in values.items() if not n.startswith("sweep_")}
    return {**values, **compile_time_defaults()}
