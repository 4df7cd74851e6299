"""The pipelines' parameter lists (derived from the one declaration, per form), the data layout, `key=value`
parsing of the CLI, and the older names users already type (issue 49 item 2)."""

from __future__ import annotations

import inspect
import warnings

import pytest

from llmft.components.lib.contracts.schema import DataLayout
from llmft.components.lib.plan.forms import Form, RenamedParameterWarning, renamed
from llmft.components.lib.plan.parameters import INTERNAL_INPUTS, OLD_NAMES, PARAMETERS
from llmft.components.plan import plan_run
from llmft.pipelines.defaults import LOCAL_DEFAULTS, parse_arguments, pipeline_inputs, run_arguments
from llmft.pipelines.llm_finetune import build_pipeline, fixed_values, llm_finetune_pipeline, pipeline_signature
from llmft.pipelines.llm_finetune_hpo import HPO_LOCAL_DEFAULTS, llm_finetune_hpo_pipeline
from llmft.trainer.errors import ConfigError


def test_the_plan_step_takes_every_declared_parameter_and_a_form_offers_its_share():
    plan_inputs = [n for n in inspect.signature(plan_run.python_func).parameters if n not in INTERNAL_INPUTS]
    assert plan_inputs == [p.name for p in PARAMETERS]
    assert list(pipeline_inputs(llm_finetune_hpo_pipeline)) == [p.name for p in Form(hpo=True).offered()]
    assert list(pipeline_inputs(llm_finetune_pipeline)) == [p.name for p in Form().offered()]
    for name, spec in pipeline_inputs(llm_finetune_pipeline).items():
        assert spec.type == llm_finetune_hpo_pipeline.component_spec.inputs[name].type, name


def test_what_each_form_offers():
    full, hpo, minimal, local = Form(), Form(hpo=True), Form(minimal=True), Form(hpo=True, local=True)
    offered = {form: {p.name for p in form.offered()} for form in (full, hpo, minimal, local)}
    compiled_in = {"hf_token_secret", "mlflow_secret", "langfuse_secret", "s3_secret", "gpu_node_selector"}
    kfp_local = {"serving_deploy_mode", "volume_path", "hpo_backend"}
    assert not compiled_in & set().union(*offered.values())  # never a field of a run's form
    assert not kfp_local & (offered[full] | offered[hpo] | offered[minimal])
    assert kfp_local <= offered[local]
    assert offered[hpo] - offered[full] == {p.name for p in PARAMETERS if p.name.startswith("hpo_")} - kfp_local
    assert len(offered[minimal]) == 11 and offered[minimal] < offered[full]


@pytest.mark.slow
def test_compile_time_defaults_replace_the_signatures():
    signature = pipeline_signature(Form(), fixed_values(Form(), {"finetune_lora_r": 32, "finetune_learning_rate": 1}))
    assert signature.parameters["finetune_lora_r"].default == 32
    assert type(signature.parameters["finetune_learning_rate"].default) is float  # KFP's type check is strict
    assert build_pipeline(defaults={"serving_deploy": False}).component_spec.inputs["serving_deploy"].default is False
    with pytest.raises(ConfigError, match="unknown pipeline parameter"):
        fixed_values(Form(), {"hpo_max_trials": 3})


def test_data_layout_paths_and_volume_relative_paths():
    layout = DataLayout("/data")
    assert layout.tokenized("abc") == "/data/tokenized/abc"
    assert layout.promoted("m", "run-1") == "/data/models/m/run-1"
    assert layout.relative("/data/models/m/run-1") == "models/m/run-1"
    with pytest.raises(ConfigError, match="not on the data volume"):
        layout.relative("/elsewhere/x")


def test_cli_arguments_are_typed_by_the_declarations():
    parsed = parse_arguments(
        ["finetune_lora_r=32", "serving_deploy=false", "finetune_learning_rate=1e-5", "base_model=org/m"]
    )
    assert parsed == {
        "finetune_lora_r": 32,
        "serving_deploy": False,
        "finetune_learning_rate": 1e-5,
        "base_model": "org/m",
    }
    assert parse_arguments(["finetune-max-steps=5", "finetune_micro_batch_size=4"]) == {
        "finetune_max_steps": 5,
        "finetune_micro_batch_size": "4",
    }
    with pytest.raises(ConfigError, match="unknown pipeline parameter `lora_rank`; did you mean `serving_max_lora_r"):
        parse_arguments(["lora_rank=8"])  # the closest name is max_lora_rank's, an old one: named by its new name
    with pytest.raises(
        ConfigError, match="unknown pipeline parameter `finetune_lora_rnk`; did you mean `finetune_lora_r`"
    ):
        parse_arguments(["finetune_lora_rnk=8"])
    with pytest.raises(ConfigError, match="not a valid integer"):
        parse_arguments(["finetune_lora_r=big"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_arguments(["finetune_lora_r"])


def test_old_names_keep_working_with_a_note_naming_the_new_one(capsys):
    """Recurring runs and scripts type ``lora_r=16``: our commands rename it (one note line on stderr)."""
    assert parse_arguments(["lora_r=8", "model=org/m", "sweep_max_trials=3"], Form(hpo=True)) == {
        "finetune_lora_r": 8,
        "base_model": "org/m",
        "hpo_max_trials": 3,
    }
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "note: pipeline parameter `lora_r` is now `finetune_lora_r` (the old name still works)"
    assert len(err) == 3
    with pytest.raises(ConfigError, match="`finetune_lora_r` is given twice"):
        parse_arguments(["lora_r=8", "finetune_lora_r=16"])
    with pytest.warns(RenamedParameterWarning, match="`train_overrides` is now `finetune_overrides`"):
        assert renamed({"train_overrides": "keep_last=1"}) == {"finetune_overrides": "keep_last=1"}
    with pytest.raises(ConfigError, match="`finetune_overrides` is given twice: `train_overrides` is its old name"):
        renamed({"train_overrides": "a=1", "finetune_overrides": "b=2"})


def test_every_old_name_maps_to_one_declared_parameter():
    names = {p.name for p in PARAMETERS}
    assert set(OLD_NAMES.values()) <= names and not set(OLD_NAMES) & names
    assert OLD_NAMES["lora_r"] == "finetune_lora_r" and OLD_NAMES["deploy_mode"] == "serving_deploy_mode"


@pytest.mark.slow
def test_a_kfp_local_caller_may_still_use_an_old_name():
    """The pipeline object itself renames, so a notebook's ``llm_finetune_pipeline(lora_r=8)`` under kfp.local
    (or a pipeline calling this one) keeps working; KFP would refuse the unknown keyword otherwise."""
    from kfp import dsl

    def outer():
        llm_finetune_pipeline(lora_r=8, finetune_max_steps=3)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled = dsl.pipeline(name="outer")(outer)  # KFP calls the function once, here
    assert compiled.pipeline_spec.root.dag.tasks
    assert any("`lora_r` is now `finetune_lora_r`" in str(w.message) for w in seen)


@pytest.mark.parametrize(
    ("item", "form", "message"),
    [
        ("serving_deploy_mode=vllm", Form(), "`serving_deploy_mode` is a kfp.local setting .* uses 'kserve'"),
        ("deploy_mode=local", Form(), "`serving_deploy_mode` is a kfp.local setting"),
        ("volume_path=/mnt", Form(minimal=True), "`volume_path` is a kfp.local setting"),
        ("hpo_max_trials=3", Form(), "`hpo_max_trials` belongs to the HPO pipeline: add --hpo"),
    ],
)
def test_a_parameter_a_form_cannot_take_is_refused_in_one_line(item, form, message):
    with pytest.raises(ConfigError, match=message):
        parse_arguments([item], form)
    assert parse_arguments([item], Form(hpo=True, local=True))  # kfp.local takes them all


def test_a_run_gets_only_its_forms_run_parameters():
    """``submit``/``schedule`` compile every argument in and pass the run parameters among them to the run."""
    arguments = {"finetune_lora_r": 8, "finetune_lora_alpha": 16.0, "hf_token_secret": "hf"}
    assert run_arguments(arguments, Form()) == {"finetune_lora_r": 8, "finetune_lora_alpha": 16.0}
    assert run_arguments(arguments, Form(minimal=True)) == {"finetune_lora_r": 8}


def test_local_defaults_name_only_real_parameters():
    local = {p.name for p in Form(hpo=True, local=True).offered()}
    assert set(LOCAL_DEFAULTS) <= local and set(HPO_LOCAL_DEFAULTS) <= local


def test_every_run_parameter_carries_its_groups_prefix_and_the_groups_sort_in_order():
    """The form reads top-down only while each group's prefix sorts after the previous group's members."""
    from llmft.components.lib.plan.forms import GROUPS, group_of

    offered = [p.name for p in Form(hpo=True, local=True).offered()]
    assert all(group_of(name) for name in offered), [n for n in offered if not group_of(n)]
    order = [prefix for prefix, _ in GROUPS]
    assert [order.index(group_of(name)) for name in offered] == sorted(order.index(group_of(n)) for n in offered)


@pytest.mark.parametrize(
    ("overrides", "real", "tiny", "profile"),
    [
        ({}, False, False, "demo"),
        ({"base_model": "/models/mine"}, False, False, "demo"),  # the demo's facts, on the user's model
        ({"dataset": "/data/mine.csv"}, False, False, "own-data"),
        ({"dataset": "/data/mine.csv"}, True, False, "real"),
        ({"dataset": "/data/mine.csv"}, False, True, "tiny"),
    ],
)
def test_a_local_run_on_the_users_own_data_drops_the_demos_facts(overrides, real, tiny, profile):
    """Was: `llmft pipeline run-local dataset=mine.csv` kept make demo's gate (heldout.contains on the made-up
    Velmora questions), so no adapter of the user's data was ever promoted and the run ended "did not learn"."""
    from llmft.pipelines.defaults import local_profile

    name, defaults = local_profile(overrides, real=real, tiny=tiny)
    assert name == profile
    if name == "own-data":
        assert "promote_eval_questions" not in defaults and "promote_metric" not in defaults
        assert "dataset" not in defaults and "serving_prompts" not in defaults
        assert defaults["serving_deploy_mode"] == "local" and defaults["base_model"] == "real"
