"""The pipelines' parameter list (derived from the plan component), the data layout, and
`key=value` parsing of the CLI."""

from __future__ import annotations

import inspect

import pytest

from llmft.components.lib.plan.parameters import INTERNAL_INPUTS, Form
from llmft.components.lib.plan.schema import DataLayout
from llmft.components.plan import plan_run
from llmft.pipelines.defaults import LOCAL_DEFAULTS, parse_arguments, pipeline_inputs
from llmft.pipelines.llm_finetune import build_pipeline, fixed_values, llm_finetune_pipeline, pipeline_signature
from llmft.pipelines.llm_finetune_hpo import HPO_LOCAL_DEFAULTS, llm_finetune_hpo_pipeline
from llmft.trainer.errors import ConfigError


def test_the_pipelines_take_exactly_the_plan_components_parameters():
    plan_inputs = [n for n in inspect.signature(plan_run.python_func).parameters if n not in INTERNAL_INPUTS]
    assert list(pipeline_inputs(llm_finetune_hpo_pipeline)) == plan_inputs
    assert list(pipeline_inputs(llm_finetune_pipeline)) == [n for n in plan_inputs if not n.startswith("sweep_")]
    for name, spec in pipeline_inputs(llm_finetune_pipeline).items():
        assert spec.type == llm_finetune_hpo_pipeline.component_spec.inputs[name].type, name


@pytest.mark.slow
def test_compile_time_defaults_replace_the_signatures():
    signature = pipeline_signature(Form(), fixed_values(Form(), {"lora_r": 32, "learning_rate": 1}))
    assert signature.parameters["lora_r"].default == 32 and signature.parameters["learning_rate"].default == 1.0
    assert type(signature.parameters["learning_rate"].default) is float  # KFP's type check is strict
    assert build_pipeline(defaults={"deploy": False}).component_spec.inputs["deploy"].default is False
    with pytest.raises(ConfigError, match="unknown pipeline parameter"):
        fixed_values(Form(), {"sweep_max_trials": 3})


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
    assert set(LOCAL_DEFAULTS) <= set(pipeline_inputs())
    assert set(HPO_LOCAL_DEFAULTS) <= set(pipeline_inputs(llm_finetune_hpo_pipeline))
