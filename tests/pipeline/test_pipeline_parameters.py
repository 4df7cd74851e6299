"""The pipeline parameters: one declaration each (PipelineParameters' fields, issue 48 item 3) that plan_run's
generated signature, the defaults and docs/pipeline-parameters.md follow; a pipeline default equal to its
trainer field's; a trainer knob's names declared once, on its config field (issue 38 item 3); and the whole
route of ``finetune_lora_r`` from the pipeline to the PEFT model."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from plan_helpers import parameters

from llmft.components.lib.plan.build import PIPELINE_SETTINGS, TRAINER_PARAMETERS
from llmft.components.lib.plan.parameters import INTERNAL_INPUTS, PARAMETERS, PipelineParameters
from llmft.components.plan import plan_run
from llmft.katib.search_space import DEFAULT_SEARCH_SPACE
from llmft.trainer.config import SETTING_NAMES, iter_fields, iter_settings
from llmft.trainer.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _signature_rows() -> list[tuple[str, object, object]]:
    signature = inspect.signature(plan_run.python_func)
    return [(n, p.annotation, p.default) for n, p in signature.parameters.items() if n not in INTERNAL_INPUTS]


def _dataclass_rows() -> list[tuple[str, object, object]]:
    hints = typing.get_type_hints(PipelineParameters)
    return [(f.name, hints[f.name], f.default) for f in dataclasses.fields(PipelineParameters)]


def test_the_typed_parameters_are_plan_runs_signature():
    """Names, types, defaults and order: a parameter added to one and not the other fails here."""
    assert _dataclass_rows() == _signature_rows()
    assert all(isinstance(default, kind) for _, kind, default in _dataclass_rows())


def test_no_read_of_the_parameters_is_any():
    """What mypy sees of ``p.x``: every field a plain scalar type, and no ``__getattr__`` that would turn an
    unknown name (or every name, as the old bag did) into ``Any``."""
    assert {kind for _, kind, _ in _dataclass_rows()} <= {str, int, float, bool}
    assert "__getattr__" not in vars(PipelineParameters) and not hasattr(PipelineParameters, "__getattr__")


def test_the_comparison_sees_a_difference():
    """The rows carry the type and the default: a changed one compares unequal."""
    rows = _signature_rows()
    index = next(i for i, row in enumerate(rows) if row[0] == "finetune_lora_r")
    assert rows[index] == ("finetune_lora_r", int, 16)
    assert [*rows[:index], ("finetune_lora_r", float, 16), *rows[index + 1 :]] != _dataclass_rows()
    assert [*rows[:index], ("finetune_lora_r", int, 8), *rows[index + 1 :]] != _dataclass_rows()


def test_parameters_are_frozen():
    p = PipelineParameters.from_values(parameters())
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.finetune_lora_r = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", r"pipeline parameter `finetune_lora_r` is missing from the plan step's inputs"),
        ("unknown", r"unknown pipeline parameter `finetune_lora_rank`; did you mean `finetune_lora_r`\?"),
        ("old", r"pipeline parameter `lora_r` is now `finetune_lora_r`: use the new name"),
    ],
)
def test_a_missing_or_unknown_name_is_refused_naming_it(change, message):
    values = parameters()
    if change == "missing":
        del values["finetune_lora_r"]
    else:
        values["finetune_lora_rank" if change == "unknown" else "lora_r"] = 8
    with pytest.raises(ConfigError, match=message):
        PipelineParameters.from_values(values)


def test_the_pipeline_settings_are_derived_from_the_config_fields():
    """Every trainer setting the pipeline sets names a declared pipeline parameter, and a pipeline parameter
    named like a setting's short name is declared as setting it (else its value would never reach the trainer)."""
    fields = {f.name for f in dataclasses.fields(PipelineParameters)}
    declared = {key: setting.pipeline for key, setting in iter_settings() if setting.pipeline}
    assert set(PIPELINE_SETTINGS) == set(declared.values()) and set(PIPELINE_SETTINGS) <= fields
    assert TRAINER_PARAMETERS == declared
    assert all(SETTING_NAMES[name] in TRAINER_PARAMETERS for name in fields & set(SETTING_NAMES))
    assert {p.name: p.config_key for p in DEFAULT_SEARCH_SPACE} == {
        name: SETTING_NAMES[name] for name in ("learning_rate", "lora_r", "lora_alpha", "lora_dropout", "warmup_ratio")
    }


def _string_constants(path: Path) -> list[str]:
    """Every string literal of the file, docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def _listed_together(path: Path, names: set[str]) -> list[list[str]]:
    """Tuple, list, set and dict literals of the file that hold two or more of ``names``: a re-listing."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict) and items:
            hits = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
            if len(hits) >= 2:
                found.append(hits)
    return found


def test_a_knobs_short_name_is_declared_once():
    """The short name (``lora_r``) and the pipeline parameter's name (``finetune_lora_r``) are written once, in
    the field's Setting (llmft/trainer/config.py); the builder's trainer settings and the sweep's default space
    derive them: they never list short names (a name that is also its trainer key, such as ``max_steps``, may be
    used there as the key)."""
    settings = [setting for _, setting in iter_settings()]
    names = [setting.name for setting in settings]
    pipeline_names = [setting.pipeline for setting in settings if setting.pipeline]
    assert len(names) == len(set(names)) == len(SETTING_NAMES), "one short name per field, each used once"
    in_config = _string_constants(REPO / "llmft" / "trainer" / "config.py")
    once = {s.name: 1 + (s.pipeline == s.name) for s in settings}  # Setting("x", pipeline="x") writes it twice
    assert {n: in_config.count(n) for n in names} == once
    assert all(in_config.count(name) == 1 for name in pipeline_names if name not in names), pipeline_names
    renamed = {name for name, key in SETTING_NAMES.items() if name != key} | set(pipeline_names)
    for derived in ("llmft/components/lib/plan/build.py", "llmft/katib/search_space.py"):
        path = REPO / derived
        assert not set(_string_constants(path)) & renamed, f"{derived} names a short name: derive it from Setting"
        assert not _listed_together(path, set(names)), f"{derived} lists settings: derive them from Setting"


DEFAULTS_DIFFER = {
    "base_model": "the trainer has no default model; the pipeline runs one",
    "mlflow_experiment": "the trainer falls back to MLFLOW_EXPERIMENT_NAME or llmft; the pipeline names its own",
}
"""Pipeline parameters whose default is not their trainer field's, and why."""


def _as_parameter(value: object) -> object:
    """A trainer default as the pipeline parameter writes it (a tuple of modules as their comma-joined list)."""
    return ",".join(value) if isinstance(value, tuple) else value


def default_mismatches(parameters: dict[str, object]) -> dict[str, tuple[object, object]]:
    """name -> (pipeline default, trainer field default) of each trainer-backed parameter whose two differ."""
    trainer = {key: default for key, _, default, _ in iter_fields()}
    return {
        name: (parameters[name], _as_parameter(trainer[key]))
        for key, name in TRAINER_PARAMETERS.items()
        if name not in DEFAULTS_DIFFER and parameters[name] != _as_parameter(trainer[key])
    }


def test_each_pipeline_default_is_its_trainer_fields_default():
    """One default per knob: the pipeline's ``finetune_lora_r`` = 16 because ``lora.r`` defaults to 16 (the
    exceptions say why); a default changed on one side only fails here."""
    defaults = {p.name: p.default for p in PARAMETERS}
    assert default_mismatches(defaults) == {}
    assert default_mismatches({**defaults, "finetune_lora_r": 8}) == {"finetune_lora_r": (8, 16)}
    assert set(DEFAULTS_DIFFER) <= set(TRAINER_PARAMETERS.values())
    assert {name: defaults[name] for name in DEFAULTS_DIFFER} == {
        "base_model": "Qwen/Qwen2.5-7B-Instruct",
        "mlflow_experiment": "llm-finetune",
    }


@pytest.mark.slow
def test_finetune_lora_r_reaches_the_peft_model(tmp_path, tiny_model_dir):
    """The whole route a reader follows (llmft/components/lib/plan/build.py's docstring): the plan step as KFP
    calls it -> PipelineParameters -> the trainer config on the volume -> the training command's config ->
    model.load_model / apply_lora -> the PEFT adapter's rank."""
    import torch
    from kfp import dsl

    from llmft.components.lib.contracts.schema import read_plan
    from llmft.trainer.config_load import load_config
    from llmft.trainer.model import load_model

    artifact = dsl.Artifact(uri=str(tmp_path / "plan"))
    values = parameters(
        base_model=str(tiny_model_dir), finetune_lora_r=4, volume_path=str(tmp_path), training_backend="local"
    )
    plan_run.python_func(plan=artifact, **values, run_id="route", compiled="")
    launch = read_plan(artifact.path).trainer.launch(str(tmp_path / "tokenized" / "k"))
    config = load_config(launch.config_path, [f"{k}={v}" for k, v in launch.overrides.items()])
    model, _ = load_model(config, torch.device("cpu"))
    assert model.peft_config["default"].r == 4


def test_the_declared_once_check_sees_a_re_listing(tmp_path):
    old = tmp_path / "old_build.py"
    old.write_text('"""doc lora_r"""\nPIPELINE_SETTINGS = ("model", "method", "lora_r")\nx = "seed"\n')
    assert _listed_together(old, set(SETTING_NAMES)) == [["model", "method", "lora_r"]]
    assert sorted(_string_constants(old)) == ["lora_r", "method", "model", "seed"]


# --- the generated files ---------------------------------------------------------------------------------

GENERATOR = REPO / "tools" / "gen_pipeline_parameters.py"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_pipeline_parameters", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plan_components_signature_is_generated_from_the_declarations(generator):
    """llmft/components/plan.py holds exactly what the generator writes (make pipeline-parameters)."""
    text = generator.PLAN_MODULE.read_text(encoding="utf-8")
    assert generator.with_plan_function(text) == text, "stale: run make pipeline-parameters"
    changed = text.replace("    finetune_lora_r: int = 16,", "    finetune_lora_r: int = 8,")
    assert changed != text and generator.with_plan_function(changed) == text


def test_the_parameter_reference_is_generated_from_the_declarations(generator):
    assert generator.REFERENCE.read_text(encoding="utf-8") == generator.render_reference(), (
        "stale: run make pipeline-parameters"
    )


@pytest.mark.slow
def test_the_generators_check_fails_on_a_stale_reference(tmp_path):
    stale = tmp_path / "pipeline-parameters.md"
    run = [sys.executable, str(GENERATOR), "--reference", str(stale)]
    subprocess.run(run, check=True, capture_output=True, timeout=120)
    assert subprocess.run([*run, "--check"], capture_output=True, timeout=120).returncode == 0
    stale.write_text(stale.read_text().replace("LoRA alpha", "LoRA alpha (edited by hand)"))
    out = subprocess.run([*run, "--check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "stale" in out.stderr
