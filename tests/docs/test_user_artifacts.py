"""The checkout's pipelines/ and components/ (what a Kubeflow user uploads) are generated from the package by
tools/gen_user_artifacts.py and never stale; the script's check is red on a stale, missing or edited file."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "gen_user_artifacts.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gen_user_artifacts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def generator(tmp_path, monkeypatch):
    """The script, writing under ``tmp_path`` two small artifacts instead of compiling the pipelines."""
    module = load_script()
    monkeypatch.setattr(module, "REPO_ROOT", tmp_path)
    files = {"pipelines/p.yaml": lambda: "p: 1\n", "components/c/c.yaml": lambda: "c\n"}
    monkeypatch.setattr(module, "artifacts", lambda: files)
    monkeypatch.setattr(module, "clean_environment", lambda: None)
    return module


def test_check_names_each_missing_file_and_writes_nothing(generator, tmp_path, capsys):
    assert generator.main(["--check"]) == 1
    assert "pipelines/p.yaml, components/c/c.yaml" in capsys.readouterr().err
    assert not (tmp_path / "pipelines").exists()


def test_writes_then_checks_clean_and_an_edit_is_stale(generator, tmp_path, capsys):
    path_before = list(sys.path)
    assert generator.main([]) == 0
    # main() leaves sys.path alone (only the script entry adds its checkout): a REPO_ROOT holding a components/
    # folder first on it made the rest of the session import `components` from there
    assert sys.path == path_before
    assert (tmp_path / "pipelines/p.yaml").read_text() == "p: 1\n"
    assert generator.main(["--check"]) == 0
    (tmp_path / "components/c/c.yaml").write_text("edited\n")
    assert generator.main(["--check"]) == 1
    assert "stale or missing: components/c/c.yaml;" in capsys.readouterr().err
    assert (tmp_path / "components/c/c.yaml").read_text() == "edited\n"  # --check wrote nothing


def test_image_overrides_are_dropped_from_the_environment(monkeypatch):
    module = load_script()
    for name in [k for k in os.environ if k.startswith("LLMFT_")]:
        monkeypatch.delenv(name)
    assert module.clean_environment() is None
    monkeypatch.setenv("LLMFT_TRAINER_IMAGE", "registry.example.com/ml/mine:1")
    monkeypatch.setenv("OTHER_SETTING", "kept")
    env = module.clean_environment()
    assert env is not None and "LLMFT_TRAINER_IMAGE" not in env and env["OTHER_SETTING"] == "kept"


@pytest.mark.slow  # compiles three pipelines and thirteen components (about 10 s)
def test_committed_pipelines_and_components_are_up_to_date():
    """Red when a component, the pipeline builder, a parameter or an image changed without `make artifacts`;
    run with an image override in the environment, which the script must drop."""
    env = {**os.environ, "LLMFT_TRAINER_IMAGE": "registry.example.com/ml/llmft-trainer:9.9.9"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_step_has_its_component_and_the_readme_names_it():
    from llmft.components.lib.plan.steps import STEPS

    readme = (REPO_ROOT / "components" / "README.md").read_text()
    for step in STEPS:
        assert (REPO_ROOT / "components" / step.task / "component.yaml").is_file(), step.task
        assert f"[`{step.task}`]({step.task}/component.yaml)" in readme
