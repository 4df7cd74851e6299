"""The KFP sweep component and the HPO pipeline: compiled structure, and the component's logic
against the real Cluster with a fake at the kubernetes-client boundary."""

from __future__ import annotations

import shlex

import pytest
import yaml
from katib_helpers import BEST, FakeKatibApi, katib_status, sweep_plan, trial_words
from kfp import dsl

from llmft.components.images import KATIB_IMAGE
from llmft.components.lib.cluster import Cluster
from llmft.components.lib.contracts.schema import write_plan
from llmft.components.lib.jobs import katib_sweep as sweep_lib
from llmft.components.sweep import sweep_hyperparameters
from llmft.katib.errors import ExperimentFailed
from llmft.pipelines.llm_finetune_hpo import TASK_ORDER, compile_pipeline
from llmft.trainer.mlflow_settings import PARENT_RUN_ENV

BEST_OVERRIDES = ["optim.lr=0.00031", "lora.r=32", "lora.alpha=64", "lora.dropout=0.02", "schedule.warmup_ratio=0.05"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("hpo") / "hpo.yaml"
    compile_pipeline(str(path))
    return list(yaml.safe_load_all(path.read_text()))


def _deps(tasks: dict, name: str) -> set[str]:
    return set(tasks[name].get("dependentTasks", []))


@pytest.mark.slow
def test_hpo_pipeline_chains_the_sweep_between_tokenize_and_train(compiled):
    spec, platform = compiled
    tasks = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]  # the steps, inside the exit handler
    up_to_promote = TASK_ORDER[: TASK_ORDER.index("promote-best-checkpoint") + 1]  # the rest: under dsl.If(promoted)
    assert {t for t in tasks if not t.startswith("condition-branches-")} == set(up_to_promote)
    assert _deps(tasks, "sweep-hyperparameters") == {"plan-run", "tokenize-dataset"}
    assert {"sweep-hyperparameters", "tokenize-dataset"} <= _deps(tasks, "train-model")
    assert tasks["train-model"]["inputs"]["parameters"]["sweep_best"] == {
        "taskOutputParameter": {"outputParameterKey": "Output", "producerTask": "sweep-hyperparameters"}
    }
    assert tasks["sweep-hyperparameters"]["inputs"]["artifacts"]["plan"]["taskOutputArtifact"]["producerTask"] == (
        "plan-run"
    )
    assert "train-model" in _deps(tasks, "evaluate-perplexity")
    executor = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-sweep-hyperparameters"]
    assert executor["pvcMount"][0]["mountPath"] == "/data"
    assert "secretAsEnv" not in executor  # compiled without mlflow_secret: nothing mounted, nothing optional
    image = spec["deploymentSpec"]["executors"]["exec-sweep-hyperparameters"]["container"]["image"]
    assert image == KATIB_IMAGE
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {"hpo_algorithm", "hpo_max_trials", "hpo_trial_overrides"} <= set(params)
    assert "hpo_backend" not in params  # katib is the only backend a cluster has (local: kfp.local only)
    names = ("hf_token_secret", "mlflow_secret", "langfuse_secret")  # Secret names, never credentials
    assert not [p for p in params if p not in names and any(w in p.lower() for w in ("token", "password", "key"))]


def _run_step(tmp_path, statuses, *, cluster=None, tokenized_dir="/data/tokenized/abc123", **changes):
    api = FakeKatibApi(statuses)
    cluster = cluster or Cluster("team-a", custom_api=api, core_api=object())
    parameters = dict(hpo_algorithm="random", hpo_max_trials=6, training_workers=2, training_gpus_per_worker=8)
    plan = sweep_plan(**{**parameters, **changes})
    result = sweep_lib.run_sweep_step(
        plan, tokenized_dir=tokenized_dir, output_dir=str(tmp_path / "out"), cluster=cluster, poll_s=0.001
    )
    return result, api


def test_step_creates_waits_and_returns_the_best(tmp_path):
    result, api = _run_step(
        tmp_path,
        [
            katib_status("Running"),
            katib_status(
                "Succeeded", best=BEST, reason="ExperimentMaxTrialsReached", trials={"trials": 6, "trialsSucceeded": 6}
            ),
        ],
    )
    assert result["best_overrides"] == BEST_OVERRIDES
    assert result["metrics"] == {
        "best_eval_loss": 1.25,
        "best_perplexity": 3.49,
        "trials_total": 6,
        "trials_succeeded": 6,
        "trials_failed": 0,
    }
    namespace, created = api.created[0]
    assert namespace == "team-a" and created["metadata"]["name"] == sweep_lib.experiment_name("run-0001")
    replicas = created["spec"]["trialTemplate"]["trialSpec"]["spec"]["pytorchReplicaSpecs"]
    assert (
        replicas["Worker"]["replicas"] == 1
        and created["spec"]["trialTemplate"]["trialSpec"]["spec"]["nprocPerNode"] == "8"
    )
    container = replicas["Master"]["template"]["spec"]["containers"][0]
    args = trial_words(container)
    assert "data=/data/tokenized/abc123" in args and "max_steps=200" in args
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "8", "memory": "64Gi"}
    assert (tmp_path / "out" / "best.txt").read_text().split() == BEST_OVERRIDES
    assert yaml.safe_load((tmp_path / "out" / "experiment.yaml").read_text())["spec"] == created["spec"]


def test_a_retried_step_reattaches_to_its_experiment(tmp_path):
    done = katib_status("Succeeded", best=BEST, reason="ExperimentMaxTrialsReached")
    _, api = _run_step(tmp_path, [done])
    cluster = Cluster("team-a", custom_api=api, core_api=object())
    result, _ = _run_step(tmp_path, [done], cluster=cluster)
    assert len(api.created) == 1 and result["best_overrides"] == BEST_OVERRIDES


def test_a_failed_experiment_fails_the_step(tmp_path):
    with pytest.raises(ExperimentFailed, match="ExperimentMaxFailedTrialsReached"):
        _run_step(
            tmp_path,
            [katib_status("Failed", reason="ExperimentMaxFailedTrialsReached", message="max failed count has reached")],
        )


def test_ranks_vllm_would_refuse_are_rejected_before_any_trial(tmp_path):
    from llmft.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="lora.r up to 64 but serving_max_lora_rank=32"):
        _run_step(tmp_path, [{}], serving_max_lora_rank=32)
    result, _ = _run_step(
        tmp_path,
        [katib_status("Succeeded", best=BEST)],
        serving_max_lora_rank=32,
        hpo_overrides="space.lora_r.values=8,16,32",
    )
    assert result["best_overrides"][1] == "lora.r=32"


def test_component_output_feeds_the_train_step(tmp_path, monkeypatch):
    best = {**BEST, "params": {k: v for k, v in BEST["params"].items() if k != "warmup_ratio"}}
    api = FakeKatibApi([katib_status("Succeeded", best=best, reason="ExperimentMaxTrialsReached")])
    monkeypatch.setattr(
        "llmft.components.lib.cluster.Cluster",
        lambda namespace=None: Cluster("team-a", custom_api=api, core_api=object()),
    )
    plan = sweep_plan(
        run_id="r1",
        hpo_max_trials=4,
        hpo_parallel_trials=2,
        hpo_max_failed_trials=1,
        hpo_overrides="space.warmup_ratio=off",
        hpo_trial_overrides="max_steps=100 eval_every=20",
        finetune_overrides="save_every=50 lora.r=8",
    )
    plan_artifact = dsl.Artifact(uri=str(tmp_path / "plan"))
    write_plan(plan, plan_artifact.path)
    tokenized = dsl.Dataset(uri=str(tmp_path / "tok"), metadata={"path": "/data/tokenized/abc"})
    artifact, metrics = dsl.Artifact(uri=str(tmp_path / "sweep")), dsl.Metrics(uri=str(tmp_path / "m"))
    output = sweep_hyperparameters.python_func(plan=plan_artifact, tokenized=tokenized, sweep=artifact, metrics=metrics)
    assert shlex.split(output) == BEST_OVERRIDES[:4]
    # what the train step does with it: the plan's config (train_overrides' lora.r=8), then data and the best
    launch = plan.trainer.launch("/data/tokenized/abc", shlex.split(output))
    assert plan.trainer.config.lora.r == 8 and launch.config_path == plan.trainer.config_path
    assert [f"{k}={v}" for k, v in launch.overrides.items()] == ["data=/data/tokenized/abc", *BEST_OVERRIDES[:4]]
    created = api.created[0][1]
    assert [p["name"] for p in created["spec"]["parameters"]] == [
        "learning_rate",
        "lora_r",
        "lora_alpha",
        "lora_dropout",
    ]
    args = trial_words(
        created["spec"]["trialTemplate"]["trialSpec"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"
        ][0]
    )
    assert "max_steps=100" in args and "eval_every=20" in args
    assert artifact.metadata["best_overrides"] == " ".join(BEST_OVERRIDES[:4])


def test_shadowed_user_values_are_warned_about(capsys):
    sweep_lib.warn_shadowed(["schedule.warmup_steps=10", "lora.r=8"], ["lora.r=32", "schedule.warmup_ratio=0.05"])
    printed = capsys.readouterr().out
    assert "the sweep's lora.r=32 replaces it" in printed
    assert "schedule.warmup_steps=10, which takes precedence over the swept schedule.warmup_ratio=0.05" in printed
    sweep_lib.warn_shadowed([], ["optim.lr=0.001"])
    assert capsys.readouterr().out == ""


def test_trial_overrides_may_not_set_what_the_sweep_sets(tmp_path):
    from llmft.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trial overrides \['optim.lr=0.1'\]"):
        _run_step(tmp_path, [{}], hpo_trial_overrides="optim.lr=0.1")
    with pytest.raises(ConfigError, match="data= is required"):
        _run_step(tmp_path, [{}], tokenized_dir="")


def test_experiment_names_are_katib_valid_and_stable():
    from llmft.katib.webhook_rules import NAME_MAX, NAME_RE

    for run_id in ("run-0001", "3f2a9c1e-77d1-4c55-9f0b-1e2d3c4b5a69", "{{$.pipeline_job_uuid}}", "UPPER_case"):
        name = sweep_lib.experiment_name(run_id)
        assert NAME_RE.match(name) and len(name) <= NAME_MAX
        assert name == sweep_lib.experiment_name(run_id)
    assert sweep_lib.experiment_name("a") != sweep_lib.experiment_name("b")


@pytest.mark.slow
def test_the_step_logic_imports_in_the_kfp_executor_runtime():
    """Inside a KFP executor `kfp.dsl` has no decorators (_KFP_RUNTIME=true): the component body's
    import must not pull a module that defines components."""
    import os
    import subprocess
    import sys

    code = (
        "import kfp.dsl as d; assert not hasattr(d, 'component'); "
        "from llmft.components.lib.jobs.katib_sweep import run_sweep_step; "
        "from llmft.components.lib.contracts.schema import read_plan; "
        "print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "_KFP_RUNTIME": "true"},
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.slow
def test_with_mlflow_the_sweep_is_a_parent_run_of_its_trials(tmp_path, monkeypatch):
    import os

    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # restored (unset) after the test
    global_uri = mlflow.get_tracking_uri()
    result, api = _run_step(
        tmp_path,
        [katib_status("Succeeded", best=BEST, reason="ExperimentMaxTrialsReached")],
        mlflow_tracking_uri=uri,
        mlflow_experiment="sweeps",
    )
    assert os.environ.pop("MLFLOW_TRACKING_URI") == uri  # the step exports its parameter for its own process
    container = api.created[0][1]["spec"]["trialTemplate"]["trialSpec"]["spec"]["pytorchReplicaSpecs"]["Master"][
        "template"
    ]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"] == uri and "observe.mlflow_experiment=sweeps" in trial_words(container)
    client = MlflowClient(uri)
    parent = client.get_run(env[PARENT_RUN_ENV])
    assert parent.info.status == "FINISHED" and parent.info.run_name.startswith("sweep-llmft-sweep-")
    assert client.get_experiment(parent.info.experiment_id).name == "sweeps"
    assert parent.data.metrics["best_eval_loss"] == 1.25 and parent.data.params["best.lora.r"] == "32"
    assert mlflow.get_tracking_uri() == global_uri  # no process-wide MLflow state changed
