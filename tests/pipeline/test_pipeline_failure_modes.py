"""The pipeline side of nothing lost, nothing silent: promote's path parameters, promoted file modes, a dead MLflow
server, a dead KFP host. docs/failure-modes.md has one row per test."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_pipeline_promote_eval import evaluation, make_checkpoint

from llmft.components.lib.evaluation.promote import promote
from llmft.components.lib.registry.mlflow_registry import Lineage, Registration, register_adapter
from llmft.trainer.errors import EXIT_TRANSIENT, ConfigError, TransientError
from llmft.trainer.io import is_complete

MLFLOW_VARS = (
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER",
)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """A proxy in the environment would carry MLflow's requests (and skip the direct check)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def _dead_port() -> int:
    import socket

    with socket.socket() as sock:  # bound, never listening, closed: nothing answers there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- item 4: path parameters


def test_promote_refuses_a_model_name_that_leaves_the_models_folder(tmp_path):
    from llmft.components.lib.evaluation.promote import promote_to_volume, promoted_destination

    data = tmp_path / "data"
    run_dir = data / "runs" / "run-1"
    make_checkpoint(run_dir, 10)
    before = sorted(str(p.relative_to(data)) for p in data.rglob("*"))
    result = evaluation(100.0, 10.0, run_dir=run_dir)

    with pytest.raises(ConfigError, match=r"mlflow_model_name='\.\./runs' is used as a folder name"):
        promote_to_volume(result, data, "../runs", "run-1", margin=0.0)
    with pytest.raises(ConfigError, match="run_id"):
        promote_to_volume(result, data, "m", "../../etc", margin=0.0)
    # the wiring that joins the path first (`<root>/models/<name>/<run>`) is refused too
    with pytest.raises(ConfigError, match=r"climbs out of its folder"):
        promote(result, f"{data}/models/../runs/run-1", margin=0.0)
    with pytest.raises(ConfigError, match="outside"):
        promote(result, data / "runs" / "run-2", margin=0.0, root=data / "models")
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == before, "something was written"

    decision = promote_to_volume(result, data, "my-model", "run-1", margin=0.0)
    assert Path(decision.destination) == promoted_destination(data, "my-model", "run-1")
    assert is_complete(data / "models" / "my-model" / "run-1")


def test_promote_refuses_a_symlink_that_leads_out_of_the_models_folder(tmp_path):
    from llmft.components.lib.evaluation.promote import promoted_destination

    data = tmp_path / "data"
    make_checkpoint(data / "runs" / "run-1", 10)
    (data / "models").mkdir()
    (data / "models" / "evil").symlink_to(data / "runs")
    with pytest.raises(ConfigError, match="outside"):
        promoted_destination(data, "evil", "run-1")


# ----------------------------------------------------------------------------- item 12: file modes


def test_promoted_safetensors_are_readable_by_a_serving_pod_of_another_uid(tmp_path):
    run_dir = tmp_path / "run"
    checkpoint = make_checkpoint(run_dir, 10)
    os.chmod(checkpoint / "adapter_model.safetensors", 0o600)  # what safetensors itself creates
    old = os.umask(0o022)
    try:
        promote(evaluation(100.0, 10.0, run_dir=run_dir), tmp_path / "models" / "m" / "r", margin=0.0)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "models" / "m" / "r").iterdir()}
    assert modes["adapter_model.safetensors"] == 0o644, modes
    assert set(modes.values()) == {0o644}, modes


# ----------------------------------------------------------------------------- item 11: a dead MLflow server


def _registration(adapter_dir: Path) -> Registration:
    lineage = Lineage(pipeline_run_id="run-a", task="register-model", dataset_hash="d" * 64, base_model="org/base")
    return Registration(
        model_name="m", experiment="llmft-tests", adapter_dir=adapter_dir, perplexity=10.0, lineage=lineage
    )


def test_register_against_a_dead_server_fails_at_once_with_one_transient_error(tmp_path, monkeypatch):
    for name in MLFLOW_VARS:
        monkeypatch.delenv(name, raising=False)
    import mlflow

    def no_client(*_args, **_kwargs):
        raise AssertionError("an MLflow client was built for a dead server")

    monkeypatch.setattr(mlflow, "MlflowClient", no_client)
    uri = f"http://user:secret@127.0.0.1:{_dead_port()}"
    with pytest.raises(TransientError) as failure:
        register_adapter(_registration(tmp_path), tracking_uri=uri)
    message = str(failure.value)
    assert failure.value.exit_code == EXIT_TRANSIENT and "\n" not in message
    assert "unreachable" in message and "Connection refused" in message and "MLFLOW_TRACKING_URI" in message
    assert "secret" not in message, "credentials in a URI are never echoed"


def test_mlflow_client_settings_are_set_once_and_user_values_win(monkeypatch):
    from mlflow.environment_variables import (
        MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR,
        MLFLOW_HTTP_REQUEST_MAX_RETRIES,
        MLFLOW_HTTP_REQUEST_TIMEOUT,
    )

    from llmft.trainer.mlflow_settings import HTTP_SETTINGS, configure_mlflow_http, prepare_mlflow

    for name in MLFLOW_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "90")  # the user's choice is kept
    effective = configure_mlflow_http()
    assert effective["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "90" and MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 90
    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == int(HTTP_SETTINGS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) < 7
    assert MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get() == int(HTTP_SETTINGS["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"])
    # a sink that goes on without MLflow gets the reason instead of an exception; local stores need no check
    reason = prepare_mlflow(f"http://127.0.0.1:{_dead_port()}", required=False)
    assert reason is not None and "unreachable" in reason
    assert prepare_mlflow("file:///tmp/mlruns", required=False) is None


# ----------------------------------------------------------------------------- item 10: a dead KFP host


@pytest.mark.slow
def test_pipeline_submit_to_a_dead_host_exits_200_with_one_line(tmp_path):
    script = Path(sys.executable).parent / "llmft"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "llmft"]
    host = f"http://127.0.0.1:{_dead_port()}"
    run = subprocess.run(
        [*command, "pipeline", "submit", "--host", host], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == EXIT_TRANSIENT, run.stderr
    assert "Traceback" not in run.stderr
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert f"--host {host}: the KFP API did not answer" in line and "Connection refused" in line
    assert not list(tmp_path.iterdir())
