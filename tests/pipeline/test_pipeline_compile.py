"""The compiled pipeline: seven tasks in order, and its Kubernetes platform section."""

from __future__ import annotations

import re

import pytest
import yaml
from llmft.pipelines.llm_finetune import GPU_STEPS, TASK_ORDER, TRAIN_RETRIES, TRAIN_TASK_TIMEOUT_S

SECRET_LOOKING = re.compile(r"token|key|password|secret|credential", re.IGNORECASE)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from llmft.cli import main

    path = tmp_path_factory.mktemp("compiled") / "pipeline.yaml"
    assert main(["pipeline", "compile", "--output", str(path)]) == 0
    spec, platform = list(yaml.safe_load_all(path.read_text()))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def _topological(tasks: dict) -> list[str]:
    order, done = [], set()
    while len(order) < len(tasks):
        ready = sorted(n for n, t in tasks.items() if n not in done and set(t.get("dependentTasks", [])) <= done)
        assert ready, f"cycle among {set(tasks) - done}"
        order += ready
        done |= set(ready)
    return order


def test_seven_tasks_run_in_order(compiled):
    spec, _ = compiled
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == set(TASK_ORDER) and len(tasks) == 7
    assert _topological(tasks) == list(TASK_ORDER)
    for before, after in zip(TASK_ORDER, TASK_ORDER[1:], strict=False):  # a chain: each waits for the previous
        assert before in tasks[after]["dependentTasks"], f"{after} does not wait for {before}"


def test_every_step_mounts_the_pvc_from_the_parameter(compiled):
    _, executors = compiled
    for task in TASK_ORDER:
        mounts = executors[f"exec-{task}"]["pvcMount"]
        assert mounts == [
            {
                "componentInputParameter": "pvc_name",
                "mountPath": "/data",
                "pvcNameParameter": {"componentInputParameter": "pvc_name"},
            }
        ], task


def _secret_envs(executor: dict) -> dict[str, tuple[str, bool]]:
    found = {}
    for entry in executor.get("secretAsEnv", []):
        for pair in entry["keyToEnv"]:
            found[pair["envVar"]] = (entry["secretName"], entry.get("optional", False))
    return found


def test_credentials_come_from_secrets_as_env(compiled):
    _, executors = compiled
    train = _secret_envs(executors["exec-train-model"])
    assert {"HF_TOKEN", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_PASSWORD", "LANGFUSE_SECRET_KEY"} <= set(train)
    assert all(optional for _, optional in train.values())
    assert "MLFLOW_TRACKING_PASSWORD" in _secret_envs(executors["exec-register-model"])
    for task in ("prepare-dataset", "tokenize-dataset", "evaluate-perplexity", "deploy-adapter"):
        assert "HF_TOKEN" in _secret_envs(executors[f"exec-{task}"]), task
    assert "secretAsEnv" not in executors["exec-promote-best-checkpoint"]  # promote needs no credential


def test_gpu_steps_are_placed_on_gpu_nodes(compiled):
    spec, executors = compiled
    for task in GPU_STEPS:
        platform = executors[f"exec-{task}"]
        assert platform["nodeSelector"]["labels"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in platform["tolerations"]
        resources = spec["deploymentSpec"]["executors"][f"exec-{task}"]["container"]["resources"]
        assert resources["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert "nodeSelector" not in executors["exec-prepare-dataset"]  # validation must not wait for a GPU


def test_train_has_timeout_and_retries(compiled):
    spec, executors = compiled
    assert executors["exec-train-model"]["activeDeadlineSeconds"] == str(TRAIN_TASK_TIMEOUT_S)
    retry = spec["root"]["dag"]["tasks"]["train-model"]["retryPolicy"]
    assert retry["maxRetryCount"] == TRAIN_RETRIES and retry["backoffDuration"] == "60s"


def test_no_parameter_is_or_holds_a_secret(compiled):
    spec, _ = compiled
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert not [name for name in parameters if SECRET_LOOKING.search(name)]
    for name, definition in parameters.items():
        default = str(definition.get("defaultValue", ""))
        assert not re.search(r"hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9]{10,}", default), name


def test_components_pin_images_and_install_nothing_at_start(compiled):
    from llmft.components import images

    spec, _ = compiled
    for name, executor in spec["deploymentSpec"]["executors"].items():
        container = executor["container"]
        assert container["image"] in (images.TRAINER_IMAGE, images.PIPELINE_IMAGE), name
        assert "pip install" not in " ".join(container["command"]), name


def test_run_id_placeholder_reaches_the_steps_that_need_a_stable_location(compiled):
    spec, _ = compiled
    tasks = spec["root"]["dag"]["tasks"]
    for task in ("prepare-dataset", "train-model", "promote-best-checkpoint", "register-model"):
        run_id = tasks[task]["inputs"]["parameters"]["run_id"]
        assert run_id == {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}, task
