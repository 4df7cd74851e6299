"""Fail-fast validation of pipeline parameters, trainer overrides, the data layout, and
`key=value` parsing of the CLI."""

from __future__ import annotations

import dataclasses

import pytest
from llmft.components.lib.params import (
    DataLayout,
    PipelineChecks,
    TrainingParams,
    trainer_overrides,
    validate_pipeline_inputs,
)
from llmft.pipelines.defaults import LOCAL_DEFAULTS, parse_arguments
from llmft.trainer.config import load_config
from llmft.trainer.errors import ConfigError

CHECKS = PipelineChecks(
    training_backend="kubeflow",
    num_workers=2,
    gpus_per_worker=8,
    max_length=2048,
    val_fraction=0.05,
    max_reject_fraction=0.01,
    promote_margin=0.01,
    pvc_name="llmft-data",
    mlflow_model_name="m",
    deploy=True,
    deploy_mode="kserve",
    serving_name="llm-adapter",
    max_lora_rank=64,
)
TRAINING = TrainingParams(model="Qwen/Qwen2.5-7B-Instruct")


def test_valid_inputs_pass():
    assert validate_pipeline_inputs(CHECKS, TRAINING) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"training_backend": "slurm"}, "training_backend"),
        ({"deploy_mode": "seldon"}, "deploy_mode"),
        ({"num_workers": 0}, "num_workers"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"promote_margin": 1.5}, "promote_margin"),
        ({"pvc_name": "Data_PVC"}, "pvc_name"),
        ({"serving_name": "Bad Name"}, "serving_name"),
        ({"max_lora_rank": 48}, "max_lora_rank"),
        ({"max_lora_rank": 8}, "exceeds `max_lora_rank`=8"),
    ],
)
def test_bad_pipeline_parameter_is_named(change, message):
    with pytest.raises(ConfigError, match=message):
        validate_pipeline_inputs(dataclasses.replace(CHECKS, **change), TRAINING)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"learning_rate": -1.0}, "optim.lr"),
        ({"method": "prefix"}, "method"),
        ({"lora_dropout": 1.5}, "lora.dropout"),
        ({"extra_overrides": "no_such_key=1"}, "unknown key `no_such_key`"),
        ({"extra_overrides": "output_dir=/elsewhere"}, "set by the pipeline"),
        ({"extra_overrides": "lora.use_dora=true"}, "DoRA"),
        ({"model": " "}, "model"),
    ],
)
def test_bad_training_parameter_fails_before_any_data_is_read(change, message):
    with pytest.raises(ConfigError, match=message):
        validate_pipeline_inputs(CHECKS, dataclasses.replace(TRAINING, **change))


def test_full_finetuning_skips_lora_serving_checks():
    full = dataclasses.replace(TRAINING, method="full", lora_r=512)
    assert validate_pipeline_inputs(dataclasses.replace(CHECKS, max_lora_rank=8), full) == []


def test_overrides_load_into_the_trainer_config():
    params = TrainingParams(
        model="m",
        lora_r=8,
        lora_alpha=16,
        lora_target_modules="q_proj,v_proj",
        learning_rate=1e-4,
        max_steps=0,
        epochs=2,
        extra_overrides="save_every=50 eval_every=25",
    )
    cfg = load_config(None, trainer_overrides(params, data_dir="/data/tokenized/k", output_dir="/data/runs/r"))
    assert (cfg.model.name_or_path, cfg.data, cfg.output_dir) == ("m", "/data/tokenized/k", "/data/runs/r")
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules) == (8, 16.0, ("q_proj", "v_proj"))
    assert (cfg.optim.lr, cfg.max_steps, cfg.epochs, cfg.save_every, cfg.eval_every) == (1e-4, 0, 2.0, 50, 25)
    assert cfg.resume == "auto"
    steps = load_config(None, trainer_overrides(dataclasses.replace(params, max_steps=7), data_dir="d", output_dir="o"))
    assert steps.max_steps == 7


def test_data_layout_paths_and_volume_relative_paths():
    layout = DataLayout("/data")
    assert layout.tokenized("abc") == "/data/tokenized/abc"
    assert layout.promoted("m", "run-1") == "/data/models/m/run-1"
    assert layout.relative("/data/models/m/run-1") == "models/m/run-1"
    with pytest.raises(ConfigError, match="not on the data volume"):
        layout.relative("/elsewhere/x")


def test_cli_arguments_are_typed_by_the_pipeline_signature():
    parsed = parse_arguments(["lora_r=32", "deploy=false", "learning_rate=1e-5", "model=org/m", "max-steps=5"])
    assert parsed == {"lora_r": 32, "deploy": False, "learning_rate": 1e-5, "model": "org/m", "max_steps": 5}
    with pytest.raises(ConfigError, match="unknown pipeline parameter `lora_rank`"):
        parse_arguments(["lora_rank=8"])
    with pytest.raises(ConfigError, match="not a valid integer"):
        parse_arguments(["lora_r=big"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_arguments(["lora_r"])


def test_local_defaults_name_only_real_parameters():
    from llmft.pipelines.defaults import pipeline_inputs

    assert set(LOCAL_DEFAULTS) <= set(pipeline_inputs())
