"""MLflow registration against a real `mlflow server` (SQLite backend, loopback)."""

from __future__ import annotations

import uuid

import pytest

from llmft.components.lib.registry.mlflow_registry import (
    CHAMPION_ALIAS,
    KEY_TAG,
    Lineage,
    Registration,
    register_adapter,
    registration_from_run,
)


@pytest.fixture
def client(mlflow_server, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    return MlflowClient(tracking_uri=mlflow_server)


def registration(model_name: str, adapter_dir, run_id: str, perplexity: float) -> Registration:
    lineage = Lineage(
        pipeline_run_id=run_id,
        task="register-model",
        dataset_hash="d" * 64,
        base_model="org/base",
        dataset="org/data",
        checkpoint="step-20",
    )
    return Registration(
        model_name=model_name,
        experiment="llmft-tests",
        adapter_dir=adapter_dir,
        perplexity=perplexity,
        lineage=lineage,
        metrics={"eval_loss": 1.5, "base_perplexity": 90.0},
        params={"lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}, "optim": {"lr": 1e-3}},
    )


@pytest.mark.slow
def test_version_is_created_with_lineage_params_metrics_and_the_adapter(client, adapter_dir):
    name = f"model-{uuid.uuid4().hex[:8]}"
    facts = register_adapter(registration(name, adapter_dir, "run-a", 12.5))
    assert facts["version"] == "1" and facts["is_champion"] and not facts["reused_existing_version"]
    version = client.get_model_version(name, "1")
    assert version.tags["llmft.pipeline_run_id"] == "run-a"
    assert version.tags["llmft.dataset_hash"] == "d" * 64 and version.tags["llmft.base_model"] == "org/base"
    assert version.tags[KEY_TAG] == "run-a/register-model"
    # no training run in this server: the adapter is logged as an MLflow Model of the registration run itself
    assert version.source.startswith("models:/") and version.run_id == facts["model_run_id"] == facts["run_id"]
    run = client.get_run(facts["run_id"])
    assert run.data.params["lora.r"] == "8" and run.data.params["lora.target_modules"] == "q_proj,v_proj"
    assert run.data.metrics["perplexity"] == 12.5 and run.data.metrics["eval_loss"] == 1.5
    assert run.info.status == "FINISHED"
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert logged.source_run_id == facts["run_id"] and logged.name == "adapter"
    assert client.get_model_version_by_alias(name, CHAMPION_ALIAS).version == "1"


@pytest.mark.slow
def test_champion_alias_moves_only_to_a_better_version(client, adapter_dir):
    name = f"model-{uuid.uuid4().hex[:8]}"
    first = register_adapter(registration(name, adapter_dir, "run-1", 20.0))
    worse = register_adapter(registration(name, adapter_dir, "run-2", 25.0))
    assert (worse["version"], worse["is_champion"], worse["champion_version"]) == ("2", False, "1")
    assert client.get_model_version_by_alias(name, CHAMPION_ALIAS).version == first["version"] == "1"
    better = register_adapter(registration(name, adapter_dir, "run-3", 15.0))
    assert (better["version"], better["is_champion"], better["previous_champion_version"]) == ("3", True, "1")
    assert client.get_model_version_by_alias(name, CHAMPION_ALIAS).version == "3"
    assert "beats champion v1" in better["alias_reason"]


@pytest.mark.slow
def test_a_retried_task_reuses_its_run_and_version(client, adapter_dir):
    name = f"model-{uuid.uuid4().hex[:8]}"
    first = register_adapter(registration(name, adapter_dir, "run-r", 10.0))
    retry = register_adapter(registration(name, adapter_dir, "run-r", 10.0))
    assert retry["reused_existing_version"] and retry["version"] == first["version"]
    assert retry["run_id"] == first["run_id"] and retry["is_champion"]
    assert len(client.search_model_versions(f"name = '{name}'")) == 1
    experiment = client.get_experiment_by_name("llmft-tests")
    runs = client.search_runs([experiment.experiment_id], f"tags.`{KEY_TAG}` = 'run-r/register-model'")
    assert len(runs) == 1


def test_registration_from_run_files(tmp_path, adapter_dir):
    evaluation = {
        "base": {"eval_loss": 4.0, "perplexity": 54.6},
        "checkpoints": [
            {"name": "step-10", "step": 10, "eval_loss": 3.0, "perplexity": 20.1},
            {"name": "step-20", "step": 20, "eval_loss": 2.5, "perplexity": 12.2},
        ],
        "best": "step-20",
    }
    manifest = {"config": {"lora": {"r": 8}}, "tokens_seen": 1000, "wall_time_s": 12.5}
    lineage = Lineage("run-x", "register-model", "abc", "base", checkpoint="step-20")
    reg = registration_from_run(
        promoted_dir=adapter_dir,
        evaluation=evaluation,
        training_manifest=manifest,
        model_name="m",
        experiment="e",
        lineage=lineage,
    )
    assert reg.perplexity == 12.2 and reg.metrics["base_perplexity"] == 54.6
    assert reg.metrics["tokens_seen"] == 1000 and reg.metrics["improvement"] == pytest.approx(1 - 12.2 / 54.6)
    assert reg.params["lora"] == {"r": 8} and reg.params["dataset_hash"] == "abc"


def test_missing_tracking_uri_is_a_clear_error(adapter_dir, monkeypatch):
    from llmft.trainer.errors import ConfigError

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI is not set"):
        register_adapter(registration("m", adapter_dir, "r", 1.0))


def test_without_a_tracking_server_the_error_names_the_plans_secret(monkeypatch):
    """The Secret named in the fix is the one the plan mounts (mlflow_secret),
    never a made-up `mlflow-credentials`."""
    from llmft.components.lib.registry.mlflow_registry import _client
    from llmft.trainer.errors import ConfigError

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError) as named:
        _client(None, "team-mlflow")
    with pytest.raises(ConfigError) as unnamed:
        _client(None, "")
    assert "`team-mlflow`" in str(named.value) and "mlflow_secret=llmft-mlflow" in str(unnamed.value)
    assert "mlflow-credentials" not in str(named.value) + str(unnamed.value)
