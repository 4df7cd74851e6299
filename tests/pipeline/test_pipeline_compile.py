"""The compiled pipelines: tasks in order, the platform section (PVC, resources, Secrets, GPU
placement), the frozen parameter lists, and images that reach the launched jobs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml

from llmft.components.lib.plan.steps import STEPS
from llmft.pipelines.llm_finetune import (
    CLEANUP_TASK,
    EXIT_GROUP,
    NOT_PROMOTED_SUMMARY,
    PROMOTED,
    TASK_ORDER,
    TRAIN_RETRIES,
    TRAIN_TASK_TIMEOUT_S,
)

ALL_TASKS = (*TASK_ORDER, NOT_PROMOTED_SUMMARY)
"""Every task of the body: a promoted run's, and the summary of a run the gate stopped."""
SERVING_TASKS = ("choose-serving-form", "register-model", "deploy-adapter", "summarize-run")
"""The tasks that run only when the promote step decided PROMOTED."""

SECRET_LOOKING = re.compile(r"token|key|password|credential", re.IGNORECASE)
SECRET_NAME_PARAMETERS = ("hf_token_secret", "mlflow_secret", "langfuse_secret", "s3_secret")
"""Parameters that hold a Secret's name (never a credential)."""

# The parameter lists, frozen: name -> (KFP type, default). Changing one is a user-facing change
# (README, docs/cluster-guide.md, docs/pipeline-parameters.md); the images' defaults depend on LLMFT_* and are
# checked apart.
FINETUNE_PARAMETERS = {
    "base_model": ("STRING", "Qwen/Qwen2.5-7B-Instruct"),
    "dataset": ("STRING", "tatsu-lab/alpaca"),
    "dataset_columns": ("STRING", ""),
    "dataset_config": ("STRING", ""),
    "dataset_format": ("STRING", "auto"),
    "dataset_max_reject_fraction": ("NUMBER_DOUBLE", 0.01),
    "dataset_split": ("STRING", "train"),
    "dataset_val_fraction": ("NUMBER_DOUBLE", 0.05),
    "finetune_batch_size": ("NUMBER_INTEGER", 8),
    "finetune_epochs": ("NUMBER_DOUBLE", 1.0),
    "finetune_eval_every": ("NUMBER_DOUBLE", 0.1),
    "finetune_learning_rate": ("NUMBER_DOUBLE", 0.0002),
    "finetune_lora_alpha": ("NUMBER_DOUBLE", 32.0),
    "finetune_lora_dropout": ("NUMBER_DOUBLE", 0.05),
    "finetune_lora_r": ("NUMBER_INTEGER", 16),
    "finetune_lora_target_modules": ("STRING", "all-linear"),
    "finetune_max_length": ("NUMBER_INTEGER", 2048),
    "finetune_max_steps": ("NUMBER_INTEGER", 0),
    "finetune_method": ("STRING", "lora"),
    "finetune_micro_batch_size": ("STRING", "auto"),
    "finetune_overrides": ("STRING", ""),
    "finetune_packing": ("BOOLEAN", True),
    "finetune_save_every": ("NUMBER_DOUBLE", 0.25),
    "finetune_seed": ("NUMBER_INTEGER", 42),
    "finetune_warmup_ratio": ("NUMBER_DOUBLE", 0.0),
    "mlflow_experiment": ("STRING", "llm-finetune"),
    "mlflow_model_name": ("STRING", "llm-adapter"),
    "mlflow_tracking_uri": ("STRING", ""),
    "promote_eval_batch_size": ("NUMBER_INTEGER", 8),
    "promote_eval_limit": ("NUMBER_INTEGER", 500),
    "promote_eval_max_questions": ("NUMBER_INTEGER", 16),
    "promote_eval_num_fewshot": ("NUMBER_INTEGER", -1),
    "promote_eval_questions": ("STRING", ""),
    "promote_eval_tasks": ("STRING", "heldout"),
    "promote_guards": ("STRING", ""),
    "promote_margin": ("NUMBER_DOUBLE", 0.01),
    "promote_metric": ("STRING", "perplexity"),
    "serving_cpu": ("STRING", "4"),
    "serving_deploy": ("BOOLEAN", True),
    "serving_deploy_policy": ("STRING", "champion"),
    "serving_deploy_timeout_s": ("NUMBER_INTEGER", 1800),
    "serving_gpus": ("NUMBER_INTEGER", 1),
    "serving_max_lora_rank": ("NUMBER_INTEGER", 64),
    "serving_memory": ("STRING", "32Gi"),
    "serving_mode": ("STRING", "auto"),
    "serving_name": ("STRING", "llm-adapter"),
    "serving_namespace": ("STRING", ""),
    "serving_prompts": ("STRING", ""),
    "serving_runtime": ("STRING", None),
    "step_cpu": ("STRING", "1"),
    "step_data_cpu": ("STRING", "4"),
    "step_data_memory": ("STRING", "16Gi"),
    "step_eval_cpu": ("STRING", "8"),
    "step_eval_memory": ("STRING", "64Gi"),
    "step_memory": ("STRING", "2Gi"),
    "training_backend": ("STRING", "pytorchjob"),
    "training_cpu": ("STRING", "8"),
    "training_gpus_per_worker": ("NUMBER_INTEGER", 1),
    "training_image": ("STRING", None),
    "training_memory": ("STRING", "64Gi"),
    "training_runtime": ("STRING", "torch-distributed"),
    "training_timeout_s": ("NUMBER_INTEGER", 86400),
    "training_workers": ("NUMBER_INTEGER", 1),
    "volume_pvc_name": ("STRING", "llmft-data"),
}
HPO_PARAMETERS = {
    "hpo_algorithm": ("STRING", "tpe"),
    "hpo_max_failed_trials": ("NUMBER_INTEGER", 3),
    "hpo_max_trials": ("NUMBER_INTEGER", 12),
    "hpo_overrides": ("STRING", ""),
    "hpo_parallel_trials": ("NUMBER_INTEGER", 3),
    "hpo_timeout_s": ("NUMBER_INTEGER", 259200),
    "hpo_trial_overrides": ("STRING", ""),
}
MINIMAL_PARAMETERS = (
    "base_model",
    "dataset",
    "dataset_columns",
    "finetune_learning_rate",
    "finetune_lora_r",
    "finetune_max_steps",
    "finetune_method",
    "mlflow_tracking_uri",
    "promote_eval_tasks",
    "promote_metric",
    "serving_namespace",
)
COMPILED_IN = {
    "gpu_node_selector": "",
    "hf_token_secret": "",
    "langfuse_secret": "",
    "mlflow_secret": "",
    "s3_secret": "",
}
"""Applied by the compiled YAML to the KFP tasks: no run parameter, a constant of the plan step."""
CLUSTER_CONSTANTS = {"serving_deploy_mode": "kserve", "volume_path": "/data"}
"""kfp.local settings: a cluster's pipeline passes the one value a cluster can use."""

# The lists before issue 49 item 2 (every parameter a run parameter, unprefixed names), kept to compare:
# each old parameter is still there, renamed, with its type and default, or compiled in with its default.
OLD_FINETUNE_PARAMETERS = {
    "model": ("STRING", "Qwen/Qwen2.5-7B-Instruct"),
    "dataset": ("STRING", "tatsu-lab/alpaca"),
    "dataset_format": ("STRING", "auto"),
    "dataset_split": ("STRING", "train"),
    "val_fraction": ("NUMBER_DOUBLE", 0.05),
    "max_reject_fraction": ("NUMBER_DOUBLE", 0.01),
    "max_length": ("NUMBER_INTEGER", 2048),
    "packing": ("BOOLEAN", True),
    "method": ("STRING", "lora"),
    "lora_r": ("NUMBER_INTEGER", 16),
    "lora_alpha": ("NUMBER_DOUBLE", 32.0),
    "lora_dropout": ("NUMBER_DOUBLE", 0.05),
    "lora_target_modules": ("STRING", "all-linear"),
    "learning_rate": ("NUMBER_DOUBLE", 0.0002),
    "epochs": ("NUMBER_DOUBLE", 1.0),
    "max_steps": ("NUMBER_INTEGER", 0),
    "seed": ("NUMBER_INTEGER", 42),
    "train_overrides": ("STRING", ""),
    "training_backend": ("STRING", "pytorchjob"),
    "training_runtime": ("STRING", "torch-distributed"),
    "num_workers": ("NUMBER_INTEGER", 1),
    "gpus_per_worker": ("NUMBER_INTEGER", 1),
    "worker_cpu": ("STRING", "8"),
    "worker_memory": ("STRING", "64Gi"),
    "gpu_node_selector": ("STRING", ""),
    "job_timeout_s": ("NUMBER_INTEGER", 86400),
    "trainer_image": ("STRING", None),
    "pvc_name": ("STRING", "llmft-data"),
    "data_root": ("STRING", "/data"),
    "hf_token_secret": ("STRING", ""),
    "mlflow_secret": ("STRING", ""),
    "langfuse_secret": ("STRING", ""),
    "step_cpu": ("STRING", "1"),
    "step_memory": ("STRING", "2Gi"),
    "data_cpu": ("STRING", "4"),
    "data_memory": ("STRING", "16Gi"),
    "eval_cpu": ("STRING", "8"),
    "eval_memory": ("STRING", "64Gi"),
    "mlflow_tracking_uri": ("STRING", ""),
    "mlflow_experiment": ("STRING", "llm-finetune"),
    "mlflow_model_name": ("STRING", "llm-adapter"),
    "promote_margin": ("NUMBER_DOUBLE", 0.01),
    "promote_metric": ("STRING", "perplexity"),
    "eval_tasks": ("STRING", "heldout"),
    "eval_questions": ("STRING", ""),
    "eval_max_questions": ("NUMBER_INTEGER", 16),
    "eval_guards": ("STRING", ""),
    "eval_num_fewshot": ("NUMBER_INTEGER", -1),
    "eval_limit": ("NUMBER_INTEGER", 500),
    "eval_batch_size": ("NUMBER_INTEGER", 8),
    "deploy": ("BOOLEAN", True),
    "deploy_mode": ("STRING", "kserve"),
    "deploy_policy": ("STRING", "champion"),
    "serving_mode": ("STRING", "auto"),
    "serving_name": ("STRING", "llm-adapter"),
    "serving_namespace": ("STRING", ""),
    "serving_gpus": ("NUMBER_INTEGER", 1),
    "serving_cpu": ("STRING", "4"),
    "serving_memory": ("STRING", "32Gi"),
    "serving_runtime": ("STRING", None),
    "max_lora_rank": ("NUMBER_INTEGER", 64),
    "serving_prompts": ("STRING", ""),
    "deploy_timeout_s": ("NUMBER_INTEGER", 1800),
}
OLD_SWEEP_PARAMETERS = {
    "sweep_backend": ("STRING", "katib"),
    "sweep_algorithm": ("STRING", "tpe"),
    "sweep_max_trials": ("NUMBER_INTEGER", 12),
    "sweep_parallel_trials": ("NUMBER_INTEGER", 3),
    "sweep_max_failed_trials": ("NUMBER_INTEGER", 3),
    "sweep_overrides": ("STRING", ""),
    "sweep_trial_overrides": ("STRING", ""),
    "sweep_timeout_s": ("NUMBER_INTEGER", 259200),
}


def _compile(tmp_path_factory, *arguments: str, hpo: bool = False, minimal: bool = False):
    from llmft.cli import main

    path = tmp_path_factory.mktemp("compiled") / "pipeline.yaml"
    flags = [*(["--hpo"] if hpo else []), *(["--minimal"] if minimal else [])]
    assert main(["pipeline", "compile", "--output", str(path), *flags, *arguments]) == 0
    text = path.read_text()
    spec, platform = list(yaml.safe_load_all(text))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"], text


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    spec, executors, _ = _compile(tmp_path_factory)
    return spec, executors


@pytest.fixture(scope="module")
def compiled_with_secrets(tmp_path_factory):
    return _compile(
        tmp_path_factory,
        "hf_token_secret=llmft-hf-token",
        "mlflow_secret=llmft-mlflow:MLFLOW_TRACKING_URI,MLFLOW_TRACKING_USERNAME,MLFLOW_TRACKING_PASSWORD",
        "langfuse_secret=llmft-langfuse",
        "s3_secret=llmft-s3:AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY,AWS_ENDPOINT_URL",
        "gpu_node_selector=nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3",
        hpo=True,
    )


def _topological(tasks: dict) -> list[str]:
    order, done = [], set()
    while len(order) < len(tasks):
        ready = sorted(n for n, t in tasks.items() if n not in done and set(t.get("dependentTasks", [])) <= done)
        assert ready, f"cycle among {set(tasks) - done}"
        order += ready
        done |= set(ready)
    return order


def _body(spec: dict) -> dict:
    """The pipeline's steps: the tasks inside the exit handler group (condition groups included)."""
    return spec["components"][f"comp-{EXIT_GROUP}"]["dag"]["tasks"]


def _flat(spec: dict, tasks: dict | None = None, outer: tuple[str, ...] = (), groups: tuple[str, ...] = ()) -> dict:
    """Every task of the body, condition groups opened: name -> task, its ``dependentTasks`` widened to the
    enclosing groups' (a task inside a condition waits for what its group waits for), ``groups`` the condition
    groups it sits in."""
    found = {}
    for name, task in (tasks if tasks is not None else _body(spec)).items():
        inner = spec["components"][task["componentRef"]["name"]].get("dag")
        deps = (*outer, *task.get("dependentTasks", []))
        if inner is not None:
            found |= _flat(spec, inner["tasks"], deps, (*groups, name))
        else:
            found[name] = {**task, "dependentTasks": sorted(set(deps)), "groups": groups}
    return found


def _artifact_source(spec: dict, task: dict, name: str) -> dict:
    """Where a task's input artifact comes from, through the condition groups' pipeline channels."""
    source = task["inputs"]["artifacts"][name]
    if "componentInputArtifact" in source:
        channel = source["componentInputArtifact"]  # pipelinechannel--<producer>-<key>
        producer, key = next(
            (t, o)
            for t in _flat(spec)
            for o in ("plan", "evaluation", "promoted")
            if channel == f"pipelinechannel--{t}-{o}"
        )
        return {"outputArtifactKey": key, "producerTask": producer}
    return source["taskOutputArtifact"]


def test_the_steps_run_inside_an_exit_handler_whose_cleanup_needs_no_other_task(compiled):
    """After the body ends, however it ends, `cleanup-run` deletes the run's
    unfinished jobs. KFP compiles it as an exit task (trigger ALL_UPSTREAM_TASKS_COMPLETED, an Argo
    exit lifecycle hook on 2.4: backend/src/v2/compiler/argocompiler/dag.go 53-100); it takes only the
    run id (PipelineTaskFinalStatus is not supported by the 2.4/2.5 backends, dag.go 612-613)."""
    spec, executors = compiled
    root = spec["root"]["dag"]["tasks"]
    assert set(root) == {EXIT_GROUP, CLEANUP_TASK}
    cleanup = root[CLEANUP_TASK]
    assert cleanup["dependentTasks"] == [EXIT_GROUP]
    assert cleanup["triggerPolicy"] == {"strategy": "ALL_UPSTREAM_TASKS_COMPLETED"}
    assert cleanup["inputs"]["parameters"]["run_id"] == {"runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}}
    assert "taskFinalStatus" not in json.dumps(cleanup)
    assert f"exec-{CLEANUP_TASK}" not in executors, "no PVC, Secret or GPU: it must run even when those fail"


def test_the_tasks_run_in_order_and_every_later_task_reads_the_plan(compiled):
    spec, _ = compiled
    tasks = _flat(spec)
    assert set(tasks) == set(ALL_TASKS) and len(tasks) == 11
    promoted = {n: t for n, t in tasks.items() if n != NOT_PROMOTED_SUMMARY}
    assert _topological(promoted) == list(TASK_ORDER)
    for before, after in zip(TASK_ORDER, TASK_ORDER[1:], strict=False):  # a chain: each waits for the previous
        assert before in tasks[after]["dependentTasks"], f"{after} does not wait for {before}"
    assert "promote-best-checkpoint" in tasks[NOT_PROMOTED_SUMMARY]["dependentTasks"]
    for name in ALL_TASKS[1:]:
        plan = _artifact_source(spec, tasks[name], "plan")
        assert plan == {"outputArtifactKey": "plan", "producerTask": "plan-run"}, name
        # nothing knob-like: the component takes the plan plus data artifacts (and KFP placeholders)
        declared = spec["components"][tasks[name]["componentRef"]["name"]]["inputDefinitions"]
        assert set(declared.get("parameters", {})) <= {"task_name", "sweep_best"}, name


def test_every_task_mounts_the_pvc_and_has_cpu_and_memory_from_parameters(compiled):
    spec, executors = compiled
    pvc = "pipelinechannel--volume_pvc_name"  # the pipeline parameter, as the exit handler group passes it on
    assert spec["components"][f"comp-{EXIT_GROUP}"]["inputDefinitions"]["parameters"][pvc] == {
        "parameterType": "STRING"
    }
    for task in ALL_TASKS:
        mounts = executors[f"exec-{task}"]["pvcMount"]
        assert mounts == [
            {"componentInputParameter": pvc, "mountPath": "/data", "pvcNameParameter": {"componentInputParameter": pvc}}
        ], task
        resources = spec["deploymentSpec"]["executors"][f"exec-{task}"]["container"]["resources"]
        group = {"prepare-dataset": "data_", "tokenize-dataset": "data_", "evaluate-perplexity": "eval_"}.get(task, "")
        group = "data_" if task == "choose-serving-form" else group  # the merge: a data-sized pod
        cpu, memory = (
            f"{{{{$.inputs.parameters['pipelinechannel--step_{group}{kind}']}}}}" for kind in ("cpu", "memory")
        )
        assert (resources["resourceCpuRequest"], resources["resourceCpuLimit"]) == (cpu, cpu), task  # not BestEffort
        assert (resources["resourceMemoryRequest"], resources["resourceMemoryLimit"]) == (memory, memory), task


def test_every_task_that_mounts_the_volume_runs_as_the_images_uid(compiled):
    """Volume ownership (issue 29.4): the container's runAsUser/runAsGroup/runAsNonRoot through
    kfp.kubernetes.set_security_context, which KFP applies from backend 2.16 (kubeflow/pipelines 2.17.0
    backend/src/v2/driver/k8s.go 749-785) and 2.4/2.5 drop without failing (backend/src/v2/compiler/visitor.go
    175, AllowUnknownFields); the volume's root belongs to that uid (deploy/volume-permissions.yaml)."""
    from llmft.components.images import IMAGE_UID

    _, executors = compiled
    mounting = [name for name, executor in executors.items() if "pvcMount" in executor]
    assert len(mounting) == len(ALL_TASKS)
    for name in mounting:
        uid = str(IMAGE_UID)  # int64 fields are JSON strings in the protobuf mapping
        assert executors[name]["securityContext"] == {"runAsUser": uid, "runAsGroup": uid, "runAsNonRoot": True}, name


def _secret_mounts(executor: dict) -> dict[str, set[str]]:
    return {
        entry["secretName"]: {pair["envVar"] for pair in entry["keyToEnv"]} for entry in executor.get("secretAsEnv", [])
    }


def test_by_default_no_secret_is_mounted_and_nothing_is_optional(compiled):
    _, executors = compiled
    assert all("secretAsEnv" not in e for e in executors.values())


@pytest.mark.slow
def test_named_secrets_are_mounted_exactly_where_needed_and_never_optional(compiled_with_secrets):
    spec, executors, text = compiled_with_secrets
    assert "optional: true" not in text  # KFP backends before 2.15 drop `optional` (kubeflow/pipelines#12216)
    for entry in (e for executor in executors.values() for e in executor.get("secretAsEnv", [])):
        assert entry.get("optional", False) is False
    mounts = {
        "hf": {"llmft-hf-token": {"HF_TOKEN"}},
        "mlflow": {"llmft-mlflow": {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}},
        "langfuse": {"llmft-langfuse": {"LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_HOST"}},
        "s3": {"llmft-s3": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"}},
    }
    expected = {task: {} for task in (*ALL_TASKS, "sweep-hyperparameters")}
    for step in STEPS:
        for kind in step.secrets:
            expected[step.task].update(mounts[kind])
    assert {task: _secret_mounts(executors[f"exec-{task}"]) for task in expected} == expected


def test_gpu_steps_get_a_gpu_and_the_compiled_node_selector(compiled, compiled_with_secrets):
    spec, executors = compiled
    for task in (step.task for step in STEPS if step.gpus):
        platform = executors[f"exec-{task}"]
        assert "nodeSelector" not in platform  # default: the GPU request alone places the pod
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in platform["tolerations"]
        resources = spec["deploymentSpec"]["executors"][f"exec-{task}"]["container"]["resources"]
        assert resources["accelerator"]["resourceType"] == "nvidia.com/gpu"
    _, executors, _ = compiled_with_secrets
    selector = executors["exec-evaluate-perplexity"]["nodeSelector"]["labels"]
    assert selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "nodeSelector" not in executors["exec-plan-run"]  # validation must not wait for a GPU


def test_the_compiled_yaml_parses_into_the_kfp_protos(compiled_with_secrets):
    """Both documents validate against KFP's own protos (strict: an unknown field is an error)."""
    from google.protobuf import json_format
    from kfp.kubernetes import kubernetes_executor_config_pb2
    from kfp.pipeline_spec import pipeline_spec_pb2

    _, executors, text = compiled_with_secrets
    spec, platform = yaml.safe_load_all(text)
    json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec())
    json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec())
    for executor in executors.values():
        json_format.ParseDict(executor, kubernetes_executor_config_pb2.KubernetesExecutorConfig())


def test_register_deploy_and_their_summary_run_only_when_the_promote_step_decided_promoted(compiled):
    """A refused promotion is a decision, not a failure (issue 44 item 2): the promote step outputs ``decision``;
    serving form, register, deploy and the summary sit in a condition on ``decision == 'promoted'``, the other
    summary in its negation. On a cluster the branch whose condition is false is not run, and nothing fails: the
    KFP v2 driver evaluates the task's ``triggerPolicy.condition`` (``willTrigger, err :=
    expr.Condition(executorInput, condition)``), records the execution with ``ecfg.NotTriggered =
    !execution.WillTrigger()`` and returns before building a pod (kubeflow/pipelines
    backend/src/v2/driver/driver.go ``Container``, the 2.5-era file at commit 0010b06; ``DAG`` does the same for
    a condition group)."""
    spec, _ = compiled
    tasks = _flat(spec)
    outputs = spec["components"]["comp-promote-best-checkpoint"]["outputDefinitions"]["parameters"]
    assert outputs == {"decision": {"parameterType": "STRING"}, "reason": {"parameterType": "STRING"}}
    branches = {g for name in ALL_TASKS for g in tasks[name]["groups"]}
    conditions = {
        name: task["triggerPolicy"]["condition"]
        for group in branches
        if (inner := spec["components"][f"comp-{group}"].get("dag"))
        for name, task in inner["tasks"].items()
        if "triggerPolicy" in task
    }
    channel = "inputs.parameter_values['pipelinechannel--promote-best-checkpoint-decision']"
    on_promoted = next(n for n, c in conditions.items() if c == f"{channel} == '{PROMOTED}'")
    otherwise = next(n for n, c in conditions.items() if c == f"!({channel} == '{PROMOTED}')")
    assert {n for n in ALL_TASKS if on_promoted in tasks[n]["groups"]} == set(SERVING_TASKS)
    assert {n for n in ALL_TASKS if otherwise in tasks[n]["groups"]} == {NOT_PROMOTED_SUMMARY}
    for name in ALL_TASKS:
        if name not in (*SERVING_TASKS, NOT_PROMOTED_SUMMARY):
            assert not tasks[name]["groups"], f"{name} must run whatever the decision"
    summaries = [spec["components"][f"comp-{n}"]["outputDefinitions"]["artifacts"]["summary"] for n in (
        "summarize-run", NOT_PROMOTED_SUMMARY)]  # fmt: skip
    assert all(s["artifactType"]["schemaTitle"] == "system.Markdown" for s in summaries)
    train_outputs = spec["components"]["comp-train-model"]["outputDefinitions"]["artifacts"]
    assert train_outputs["loss_curve"]["artifactType"]["schemaTitle"] == "system.HTML"


def test_train_has_timeout_and_retries(compiled):
    spec, executors = compiled
    assert executors["exec-train-model"]["activeDeadlineSeconds"] == str(TRAIN_TASK_TIMEOUT_S)
    retry = _body(spec)["train-model"]["retryPolicy"]
    assert retry["maxRetryCount"] == TRAIN_RETRIES and retry["backoffDuration"] == "60s"


def _parameters(spec: dict) -> dict[str, tuple[str, object]]:
    out = {}
    for name, definition in spec["root"]["inputDefinitions"]["parameters"].items():
        default = definition.get("defaultValue")
        if definition["parameterType"] == "NUMBER_INTEGER":
            default = int(default)
        out[name] = (definition["parameterType"], None if name in ("training_image", "serving_runtime") else default)
    return out


def _plan_inputs(spec: dict) -> dict:
    """What the pipeline hands the plan step, input by input: a run parameter's channel or a constant."""
    return _body(spec)["plan-run"]["inputs"]["parameters"]


def test_the_parameter_lists_are_frozen_and_the_pipelines_agree(compiled, compiled_with_secrets):
    spec, _ = compiled
    hpo_spec, _, _ = compiled_with_secrets
    assert _parameters(spec) == FINETUNE_PARAMETERS
    assert _parameters(hpo_spec) == {**FINETUNE_PARAMETERS, **HPO_PARAMETERS}
    for name, definition in hpo_spec["root"]["inputDefinitions"]["parameters"].items():
        assert len(definition.get("description", "")) > 10, f"{name} has no description for the KFP UI"
    assert "LoRA rank" in spec["root"]["inputDefinitions"]["parameters"]["finetune_lora_r"]["description"]


def test_the_form_lists_the_parameters_in_the_order_they_are_declared():
    """The KFP UI shows a form's parameters sorted by name (docs/pipeline-parameters.md cites why), so the
    declaration order, the docs' order and the form's order are one order only while names sort as declared."""
    from llmft.components.lib.plan.forms import Form

    for form in (Form(), Form(hpo=True), Form(minimal=True), Form(hpo=True, minimal=True), Form(local=True)):
        names = [p.name for p in form.offered()]
        assert names == sorted(names), form
    assert [p.name for p in Form(minimal=True).offered()] == list(MINIMAL_PARAMETERS)
    assert list(FINETUNE_PARAMETERS) == sorted(FINETUNE_PARAMETERS)


def test_the_new_form_keeps_every_old_parameter(compiled, compiled_with_secrets):
    """Against the lists before the rename: each old parameter is a run parameter under its new name with the
    same type and default, or (compiled in, or a kfp.local setting) a constant of the plan step with its old
    default; what the run parameters add is the training knobs once only in finetune_overrides, and the data's
    hub configuration and column mapping (issue 49 item 1; its s3_secret is compiled in)."""
    from llmft.components.lib.plan.parameters import OLD_NAMES

    for (spec, *_), old in ((compiled, OLD_FINETUNE_PARAMETERS), (compiled_with_secrets, OLD_SWEEP_PARAMETERS)):
        now, inputs = _parameters(spec), _plan_inputs(spec)
        for name, (kind, default) in old.items():
            new = OLD_NAMES.get(name, name)
            if new in now:
                assert now[new] == (kind, default), name
            else:
                assert new in {**COMPILED_IN, **CLUSTER_CONSTANTS, "hpo_backend": "katib"}, name
                if new not in COMPILED_IN or spec is compiled[0]:
                    assert inputs[new] == {"runtimeValue": {"constant": default}}, name
    added = set(FINETUNE_PARAMETERS) - {OLD_NAMES.get(n, n) for n in OLD_FINETUNE_PARAMETERS}
    assert added == {f"finetune_{k}" for k in ("batch_size", "eval_every", "micro_batch_size", "save_every")} | {
        "finetune_warmup_ratio",
        "dataset_config",
        "dataset_columns",
    }


def test_values_fixed_when_compiling_are_constants_of_the_plan_step(compiled_with_secrets):
    """The Secrets and the evaluate node selector are applied by the compiled YAML itself (backends before 2.5
    take them from no parameter): no field of the run's form, and the plan step checks the very values the
    tasks mount."""
    spec, executors, _ = compiled_with_secrets
    inputs = _plan_inputs(spec)
    assert not set(COMPILED_IN) & set(spec["root"]["inputDefinitions"]["parameters"])
    assert inputs["hf_token_secret"] == {"runtimeValue": {"constant": "llmft-hf-token"}}
    assert inputs["gpu_node_selector"] == {"runtimeValue": {"constant": "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"}}
    assert _secret_mounts(executors["exec-prepare-dataset"])["llmft-hf-token"] == {"HF_TOKEN"}
    assert inputs["s3_secret"] == {
        "runtimeValue": {"constant": "llmft-s3:AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY,AWS_ENDPOINT_URL"}
    }
    assert _secret_mounts(executors["exec-prepare-dataset"])["llmft-s3"] == {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ENDPOINT_URL",
    }
    assert inputs["serving_deploy_mode"] == {"runtimeValue": {"constant": "kserve"}}  # local and vllm: kfp.local
    assert inputs["hpo_backend"] == {"runtimeValue": {"constant": "katib"}}


@pytest.mark.slow
def test_the_minimal_pipeline_offers_eleven_parameters_and_compiles_in_the_rest(tmp_path_factory):
    """``llmft pipeline compile --minimal``: the same steps, eleven run parameters; every other value (given here,
    or the declared default) reaches the plan step as a constant."""
    spec, executors, _ = _compile(tmp_path_factory, "finetune_lora_alpha=8", "volume_pvc_name=team-data", minimal=True)
    assert list(_parameters(spec)) == list(MINIMAL_PARAMETERS)
    assert spec["pipelineInfo"]["name"] == "llm-finetune-minimal"
    assert set(_flat(spec)) == set(ALL_TASKS)  # the same steps, serving ones under the promote decision
    inputs = _plan_inputs(spec)
    assert inputs["finetune_lora_r"] == {"componentInputParameter": "pipelinechannel--finetune_lora_r"}
    assert inputs["finetune_lora_alpha"] == {"runtimeValue": {"constant": 8.0}}
    assert inputs["step_data_cpu"] == {"runtimeValue": {"constant": "4"}}
    assert executors["exec-plan-run"]["pvcMount"][0]["constant"] == "team-data"


def test_no_parameter_is_or_holds_a_secret(compiled):
    spec, _ = compiled
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert not [name for name in parameters if SECRET_LOOKING.search(name) and name not in SECRET_NAME_PARAMETERS]
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


def test_run_id_placeholder_reaches_the_plan(compiled):
    spec, _ = compiled
    tasks = _body(spec)
    assert tasks["plan-run"]["inputs"]["parameters"]["run_id"] == {
        "runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}
    }


BUILD_FROM_COMPILED = textwrap.dedent(
    """
    import json, os, sys, yaml
    assert not [k for k in os.environ if k.startswith("LLMFT_")], "the launcher pod has no LLMFT_* variable"
    from llmft.components.lib.serving.deployment import DeployRequest, serve_spec
    from llmft.components.lib.plan.build import build_plan
    from llmft.components.lib.plan.parameters import BY_NAME
    from llmft.components.lib.jobs.pytorchjob_spec import build_pytorchjob, pytorchjob_to_dict
    from llmft.components.lib.serving.inferenceservice import build_inference_service, isvc_to_dict
    from llmft.components.lib.jobs.katib_sweep import sweep_trial_job
    from llmft.components.lib.jobs.pytorchjob_launch import build_job_spec
    from llmft.katib.experiment import SweepSpec, apply_overrides

    spec = next(yaml.safe_load_all(open(sys.argv[1])))
    values = {n: d.get("defaultValue") for n, d in spec["root"]["inputDefinitions"]["parameters"].items()}
    values = {n: int(v) if d["parameterType"] == "NUMBER_INTEGER" else v
              for (n, v), d in zip(values.items(), spec["root"]["inputDefinitions"]["parameters"].values())}
    values["mlflow_tracking_uri"] = "http://mlflow:5000"
    body = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    fixed = body["plan-run"]["inputs"]["parameters"]  # what the pipeline compiled in: constants of the plan step
    values |= {n: v["runtimeValue"]["constant"] for n, v in fixed.items() if n in BY_NAME and "runtimeValue" in v}
    compiled = body["plan-run"]["inputs"]["parameters"]["compiled"]["runtimeValue"]["constant"]
    plan = build_plan(values, run_id="run-1", compiled=compiled, environ={"KFP_POD_NAME": "p"})
    job = pytorchjob_to_dict(build_pytorchjob(build_job_spec(plan.job, plan.trainer.launch("/d"))))
    sweep = apply_overrides(SweepSpec(name=plan.sweep.experiment), list(plan.sweep.settings))
    trial = sweep_trial_job(sweep, job=plan.job, config_path=plan.trainer.config_path, data="/data/tokenized/k")
    request = DeployRequest(adapter_dir="/data/models/m/run-1", base_model="org/m", adapter_name="m", version="1",
        deploy=True, mode="kserve", name="m", namespace="", gpus=1, max_lora_rank=64, pvc_name="llmft-data",
        data_root="/data", runtime=plan.serving.runtime)
    isvc = isvc_to_dict(build_inference_service(serve_spec(request)))
    container = lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    print(json.dumps({"job": container(job)["image"], "trial": container(trial)["image"],
                      "runtime": isvc["spec"]["predictor"]["model"]["runtime"]}))
    """
)


@pytest.mark.slow
def test_the_compiled_images_reach_the_job_the_trials_and_the_inference_service(tmp_path):
    """Compile with LLMFT_* set; build the jobs where no LLMFT_* variable exists (the launcher pod)."""
    image = "registry.example.com/ml/llmft-trainer:9.9.9"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMFT_")}
    compile_env = {**clean, "LLMFT_TRAINER_IMAGE": image, "LLMFT_SERVING_RUNTIME": "my-vllm-runtime"}
    package = tmp_path / "hpo.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "llmft", "pipeline", "compile", "--hpo", "--output", str(package)],
        env=compile_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    script = tmp_path / "build.py"
    script.write_text(BUILD_FROM_COMPILED)
    built = subprocess.run(
        [sys.executable, str(script), str(package)], env=clean, capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, built.stderr
    # the last line: the plan step prints its notes (volume, grace period) before
    assert json.loads(built.stdout.splitlines()[-1]) == {"job": image, "trial": image, "runtime": "my-vllm-runtime"}
