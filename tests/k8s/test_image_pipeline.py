"""The pure parts of tools/image_pipeline.py (`make image-check` runs the pipelines with every task on its
image's Python): which interpreter and environment a task gets, the hub cache it fills, and the trainer
processes of the local backends (LLMFT_LOCAL_TRAINER_PYTHON, llmft/components/images.py)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmft.components import images
from llmft.components.lib.contracts.schema import TrainerLaunch
from llmft.components.lib.jobs.local_train import train_command

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tools"))  # tools/ is no package; image_check imports it the same way
import image_pipeline  # noqa: E402

ENVS = {
    "pipeline": {"VIRTUAL_ENV": "/w/pipeline/opt/llmft", "PATH": "/w/pipeline/opt/llmft/bin:/usr/bin"},
    "trainer": {"VIRTUAL_ENV": "/w/trainer/opt/llmft", "PATH": "/w/trainer/opt/llmft/bin:/usr/bin"},
}


@pytest.fixture
def reloaded_images(monkeypatch):
    """llmft/components/images.py re-read with the environment the test sets, restored afterwards."""
    for name in (images.TRAINER_IMAGE_ENV, images.PIPELINE_IMAGE_ENV, images.KATIB_IMAGE_ENV):
        monkeypatch.delenv(name, raising=False)
    yield lambda: importlib.reload(images)
    monkeypatch.undo()
    importlib.reload(images)


def test_each_base_image_runs_on_the_python_of_the_dockerfile_that_builds_it(reloaded_images):
    roles = reloaded_images().dockerfile_roles()
    python = {image: image_pipeline.task_interpreter(image, roles, ENVS) for image in images.all_images().values()}
    assert python[images.PIPELINE_IMAGE] == "/w/pipeline/opt/llmft/bin/python3"
    assert python[images.KATIB_IMAGE] == "/w/pipeline/opt/llmft/bin/python3"  # the same image unless overridden
    assert python[images.TRAINER_IMAGE] == "/w/trainer/opt/llmft/bin/python3"
    assert set(roles.values()) == set(images.DOCKERFILES)  # every role is a Dockerfile image_check builds
    with pytest.raises(image_pipeline.PipelineCheckFailed, match="python:3.11 is built by no Dockerfile"):
        image_pipeline.task_interpreter("python:3.11", roles, ENVS)


def test_an_overridden_image_still_runs_on_its_dockerfiles_python(reloaded_images, monkeypatch):
    monkeypatch.setenv(images.KATIB_IMAGE_ENV, "registry.example.com/ml/katib-steps:1.0")
    monkeypatch.setenv(images.TRAINER_IMAGE_ENV, "registry.example.com/ml/trainer:2.0")
    roles = reloaded_images().dockerfile_roles()
    assert image_pipeline.task_interpreter("registry.example.com/ml/katib-steps:1.0", roles, ENVS).startswith(
        "/w/pipeline/"
    )
    assert image_pipeline.task_interpreter("registry.example.com/ml/trainer:2.0", roles, ENVS).startswith("/w/trainer/")


def test_a_task_sees_the_images_environment_not_this_processes_python():
    ours = {"PYTHONPATH": "/checkout", "VIRTUAL_ENV": "/checkout/.venv", "PATH": "/checkout/.venv/bin", "OMP": "1"}
    env = image_pipeline.task_environment(ours, ENVS["pipeline"], {"PATH": "/task", "K": "v"}, "/w/t/bin/python3")
    assert "PYTHONPATH" not in env and env["VIRTUAL_ENV"] == "/w/pipeline/opt/llmft" and env["OMP"] == "1"
    assert env["PATH"] == "/task" and env["K"] == "v"  # the task's own variables (set_env_variable) win
    assert env["PYTHONSAFEPATH"] == "1"  # the working directory (a checkout) never shadows the installed wheel
    assert env[images.LOCAL_TRAINER_PYTHON_ENV] == "/w/t/bin/python3"
    assert image_pipeline.function_of(["sh", "-c", "x", "--executor_input", "{}", "--function_to_execute", "f"]) == "f"


def test_the_local_backends_train_on_the_named_python(monkeypatch):
    """A pipeline-image step has no torch: its local trainer (as a cluster's trainer-image pod) runs elsewhere."""
    monkeypatch.delenv(images.LOCAL_TRAINER_PYTHON_ENV, raising=False)
    assert train_command(TrainerLaunch("/c.yaml", {}))[0] == sys.executable
    monkeypatch.setenv(images.LOCAL_TRAINER_PYTHON_ENV, "/w/trainer/opt/llmft/bin/python3")
    assert train_command(TrainerLaunch("/c.yaml", {}))[:3] == ["/w/trainer/opt/llmft/bin/python3", "-m", "llmft"]


def test_the_local_sweep_trials_train_on_the_named_python(monkeypatch, tmp_path):
    from llmft.components.lib.jobs import katib_sweep as sweep
    from llmft.katib import local_sweep

    seen = {}

    def capture(spec, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("captured")

    monkeypatch.setattr(local_sweep, "run_local_sweep", capture)
    monkeypatch.setenv(images.LOCAL_TRAINER_PYTHON_ENV, "/w/trainer/opt/llmft/bin/python3")
    with pytest.raises(RuntimeError, match="captured"):
        sweep._run_local(SimpleNamespace(max_trials=1), "/tok", "/c.yaml", [], str(tmp_path), "")
    assert seen["python"] == "/w/trainer/opt/llmft/bin/python3"


def test_the_local_sweep_trials_read_the_volumes_hub_cache(monkeypatch, tmp_path):
    """Found by the hub-id run in the images: the trials looked for a hub model in the sweep step's default
    cache (the image's HF_HOME), not on the volume where the train step's trainer finds it."""
    from llmft.components.lib.contracts.schema import DataLayout
    from llmft.components.lib.jobs import katib_sweep as sweep
    from llmft.katib import local_sweep

    seen = {}

    def capture(spec, **kwargs):
        seen.update({k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_CACHE")})
        raise RuntimeError("captured")

    for name in ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.setenv(name, "/home/llmft/.cache/huggingface")  # the trainer image's ENV; restored after
    monkeypatch.setattr(local_sweep, "run_local_sweep", capture)
    sweep_plan = SimpleNamespace(
        experiment="llmft-sweep-1", settings=(), trial_overrides=(), backend="local", workdir=""
    )
    plan = SimpleNamespace(
        sweep=sweep_plan,
        trainer=SimpleNamespace(config_path="/c.yaml"),
        registry=SimpleNamespace(tracking_uri="", experiment="", enabled=False),
        layout=DataLayout(str(tmp_path)),
    )
    with pytest.raises(RuntimeError, match="captured"):
        sweep.run_sweep_step(plan, tokenized_dir="/tok", output_dir=str(tmp_path / "out"))
    assert seen == {"HF_HOME": f"{tmp_path}/hf-cache", "HF_HUB_CACHE": f"{tmp_path}/hf-cache/hub"}


def test_the_hub_cache_is_what_huggingface_hub_finds_offline(tmp_path):
    from huggingface_hub import try_to_load_from_cache

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    snapshot = image_pipeline.hub_cache(tmp_path / "hub", model, "org/tiny", "d" * 40)
    found = try_to_load_from_cache("org/tiny", "config.json", cache_dir=tmp_path / "hub")
    assert found == str(snapshot / "config.json") and json.loads(Path(found).read_text()) == {"hidden_size": 8}
    assert image_pipeline.hub_cache(tmp_path / "hub", model, "org/tiny", "d" * 40) == snapshot  # again: kept


def test_the_cases_cover_a_model_directory_a_hub_id_and_the_sweep():
    cases = image_pipeline.CASES
    assert {(c.hpo, c.hub) for c in cases} == {(False, False), (True, True)}
    hub = next(c for c in cases if c.hub)
    assert hub.overrides["base_model"] == image_pipeline.HUB_ID
    assert all("base_model" not in c.overrides for c in cases if not c.hub)  # run-local's tiny model on the volume
    assert [c.name for c in cases if c.render] == [hub.name]  # render-job --hpo for both backends, in the image


@pytest.mark.slow
def test_kfp_local_runs_a_task_on_its_images_python(tmp_path, monkeypatch):
    """A real kfp.local run of a one-task pipeline: the task's interpreter and environment are the image's."""
    from kfp import dsl, local

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # stands for the image's
    (venv / "bin" / "python3").chmod(0o755)

    def where() -> str:
        import os
        import sys

        return f"{sys.flags.safe_path} {os.environ['VIRTUAL_ENV']} {os.environ['LLMFT_LOCAL_TRAINER_PYTHON']}"

    where.__annotations__ = {"return": str}  # KFP reads real annotations; this module's are strings
    where = dsl.component(base_image=images.PIPELINE_IMAGE, install_kfp_package=False)(where)

    envs = {role: {**os.environ, "VIRTUAL_ENV": str(venv)} for role in images.DOCKERFILES}
    record: list = []
    local.init(local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    with image_pipeline.tasks_in_images(image_pipeline.image_task_handler(envs, tmp_path, record)):
        task = where()
    assert task.output == f"True {venv} {venv}/bin/python3"
    assert [(r.function, r.python, r.exit_code) for r in record] == [("where", f"{venv}/bin/python3", 0)]
    from kfp.local import subprocess_task_handler

    assert subprocess_task_handler.SubprocessTaskHandler.__name__ == "SubprocessTaskHandler"  # restored
