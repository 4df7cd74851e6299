"""Fixtures of the pipeline tests: a real `mlflow server` on loopback, the one shared kfp.local
run of the whole pipeline, and the Kubernetes fakes of tests/k8s (reused, not copied)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

K8S_TESTS = Path(__file__).resolve().parents[1] / "k8s"
if str(K8S_TESTS) not in sys.path:  # k8s_fakes.py: fakes at the kubernetes-client boundary
    sys.path.insert(0, str(K8S_TESTS))

MLFLOW_START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + MLFLOW_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"mlflow server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"mlflow server not healthy after {MLFLOW_START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """URI of a real `mlflow server` (SQLite backend, loopback, one worker), stopped at teardown."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = root / "server.log"
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "mlartifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job consumers
    with open(log, "w") as fh:
        process = subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log)
        yield url
    finally:
        _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    """Stop the server and any children it started (its own process group, created above)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)


@pytest.fixture(scope="session")
def local_run(tmp_path_factory):
    """The whole pipeline through kfp.local on the tiny model, run once and shared."""
    from llmft.pipelines.local_run import run_pipeline_locally

    work = tmp_path_factory.mktemp("pipeline-local")
    started = time.perf_counter()
    outcome = run_pipeline_locally({}, work_dir=work)
    outcome.elapsed_s = time.perf_counter() - started
    if not outcome.succeeded:
        pytest.fail(outcome.render(outcome.elapsed_s) + "\n" + outcome.log_path.read_text()[-6000:])
    return outcome


@pytest.fixture
def adapter_dir(tmp_path):
    """A minimal adapter folder to register (tests/pipeline/test_pipeline_registry.py, test_pipeline_champion.py)."""
    path = tmp_path / "adapter"
    path.mkdir()
    (path / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    return path
