"""Step 1: validate every pipeline input, then convert the dataset to validated JSONL."""
# No `from __future__ import annotations` in component modules: KFP reads the real annotation objects.

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output
from llmft.components.images import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def prepare_dataset(
    dataset: str,
    dataset_format: str,
    dataset_split: str,
    val_fraction: float,
    max_reject_fraction: float,
    seed: int,
    data_root: str,
    run_id: str,
    model: str,
    method: str,
    lora_r: int,
    lora_alpha: float,
    lora_dropout: float,
    lora_target_modules: str,
    learning_rate: float,
    epochs: float,
    max_steps: int,
    train_overrides: str,
    training_backend: str,
    num_workers: int,
    gpus_per_worker: int,
    max_length: int,
    promote_margin: float,
    pvc_name: str,
    mlflow_model_name: str,
    deploy: bool,
    deploy_mode: str,
    serving_name: str,
    max_lora_rank: int,
    prepared: Output[Dataset],
    metrics: Output[Metrics],
):
    """Fail fast on bad parameters, then write train/val/rejects JSONL and a report.

    Every pipeline parameter that later steps use is checked first (the trainer config the
    train step will load, backend and deploy settings, LoRA rank vs the vLLM limit), so a
    mistake costs seconds on a CPU pod instead of a GPU job. Then the dataset (hub id or a
    file/folder on the volume) is converted to the canonical schema under
    ``<data_root>/datasets/<run_id>``; rows that fail validation go to rejects.jsonl, and the
    step fails when more than ``max_reject_fraction`` of them are rejected.

    Outputs: ``prepared`` (report.json; metadata ``path`` = the folder on the volume) and
    ``metrics`` (rows accepted and rejected).
    """
    import json
    import os

    from llmft.components.lib.params import (
        DataLayout,
        PipelineChecks,
        TrainingParams,
        validate_pipeline_inputs,
    )
    from llmft.trainer.data.prepare import prepare_dataset as prepare

    training = TrainingParams(
        model=model,
        method=method,
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        lora_target_modules=lora_target_modules,
        learning_rate=learning_rate,
        epochs=epochs,
        max_steps=max_steps,
        seed=seed,
        extra_overrides=train_overrides,
    )
    checks = PipelineChecks(
        training_backend=training_backend,
        num_workers=num_workers,
        gpus_per_worker=gpus_per_worker,
        max_length=max_length,
        val_fraction=val_fraction,
        max_reject_fraction=max_reject_fraction,
        promote_margin=promote_margin,
        pvc_name=pvc_name,
        mlflow_model_name=mlflow_model_name,
        deploy=deploy,
        deploy_mode=deploy_mode,
        serving_name=serving_name,
        max_lora_rank=max_lora_rank,
    )
    for warning in validate_pipeline_inputs(checks, training):
        print(f"WARNING: {warning}")
    print("pipeline parameters: ok")

    layout = DataLayout(data_root)
    layout.use_hf_cache()
    output_dir = layout.prepared(run_id)
    report = prepare(
        dataset,
        output_dir,
        format=dataset_format,
        split=dataset_split,
        val_fraction=val_fraction,
        seed=seed,
        max_reject_fraction=max_reject_fraction,
    )

    os.makedirs(prepared.path, exist_ok=True)
    with open(os.path.join(prepared.path, "report.json"), "w") as fh:
        json.dump(report, fh, indent=2, sort_keys=True, default=str)
    prepared.metadata.update(
        {
            "path": output_dir,
            "accepted": report["accepted"],
            "rejected": report["rejected"],
            "format": str(report.get("format", dataset_format)),
            "source_hash": str(report.get("source_hash", "")),
        }
    )
    metrics.log_metric("rows_accepted", report["accepted"])
    metrics.log_metric("rows_rejected", report["rejected"])
    print(f"prepared {report['accepted']} rows ({report['rejected']} rejected) into {output_dir}")
