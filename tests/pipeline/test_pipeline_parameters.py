"""The pipeline parameters: one frozen, typed value (PipelineParameters) equal to plan_run's signature,
and a trainer knob's short name declared once, on its config field (issue 38 item 3)."""

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
from llmft.components.lib.plan.parameters import INTERNAL_INPUTS, PipelineParameters
from llmft.components.plan import plan_run
from llmft.katib.search_space import DEFAULT_SEARCH_SPACE
from llmft.trainer.config import SETTING_NAMES, iter_settings
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
    index = next(i for i, row in enumerate(rows) if row[0] == "lora_r")
    assert rows[index] == ("lora_r", int, 16)
    assert [*rows[:index], ("lora_r", float, 16), *rows[index + 1 :]] != _dataclass_rows()
    assert [*rows[:index], ("lora_r", int, 8), *rows[index + 1 :]] != _dataclass_rows()


def test_parameters_are_frozen():
    p = PipelineParameters.from_values(parameters())
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.lora_r = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", r"pipeline parameter `lora_r` is missing from the plan step's inputs"),
        ("unknown", r"pipeline parameter `lora_rank` is unknown \(known: model, dataset, "),
    ],
)
def test_a_missing_or_unknown_name_is_refused_naming_it(change, message):
    values = parameters()
    if change == "missing":
        del values["lora_r"]
    else:
        values["lora_rank"] = 8
    with pytest.raises(ConfigError, match=message):
        PipelineParameters.from_values(values)


def test_the_pipeline_settings_are_derived_from_the_config_fields():
    """Every trainer setting the pipeline sets is a pipeline parameter, and a pipeline parameter that
    shares a setting's short name is declared as setting it (else its value would never reach the trainer)."""
    fields = {f.name for f in dataclasses.fields(PipelineParameters)}
    assert set(PIPELINE_SETTINGS) <= fields, sorted(set(PIPELINE_SETTINGS) - fields)
    assert fields & set(SETTING_NAMES) == set(PIPELINE_SETTINGS)
    assert TRAINER_PARAMETERS == {SETTING_NAMES[name]: name for name in PIPELINE_SETTINGS}
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
    """The short name (``lora_r``) is written once, in the field's Setting (llmft/trainer/config.py); the
    builder's trainer settings and the sweep's default space derive it: they never list short names (a
    name that is also its trainer key, such as ``max_steps``, may be used there as the key)."""
    names = [setting.name for _, setting in iter_settings()]
    assert len(names) == len(set(names)) == len(SETTING_NAMES), "one short name per field, each used once"
    in_config = _string_constants(REPO / "llmft" / "trainer" / "config.py")
    assert all(in_config.count(name) == 1 for name in names), {n: in_config.count(n) for n in names}
    renamed = {name for name, key in SETTING_NAMES.items() if name != key}
    for derived in ("llmft/components/lib/plan/build.py", "llmft/katib/search_space.py"):
        path = REPO / derived
        assert not set(_string_constants(path)) & renamed, f"{derived} names a short name: derive it from Setting"
        assert not _listed_together(path, set(names)), f"{derived} lists settings: derive them from Setting"


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
    changed = text.replace("    lora_r: int = 16,", "    lora_r: int = 8,")
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
