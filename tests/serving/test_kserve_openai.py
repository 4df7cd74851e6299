"""The deploy step's smoke test against KServe's own OpenAI serving code (issue 33 item 3).

KServe's Hugging Face runtime registers each ``--lora-modules`` name onto the base model's object, and its
``GET /openai/v1/models`` answers ``id = model.name`` per registry entry: the base name twice, never the
adapter's. These tests run the real ``kserve`` package (0.21.0: ModelServer, ModelRepository, the OpenAI
routes and dataplane; tools/kserve-openai-requirements.txt, built beside the serving venv's vLLM by
``make serving-venv``) on loopback with real HTTP, the model registered as the runtime registers it, and a
stand-in for vLLM's engine (tests/serving/kserve_openai_server.py says what is real and what stands in).
The arguments are the deploy step's own (``server_args`` of the manifest). The KServe simulator's listing
(tests/k8s/cluster_sim.py ``FakeVllm``) is held to what KServe's code answers here.

Three servers start at once (about 1-2 minutes on 2 cores: importing vLLM's protocol classes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from llmft.components.lib.serving.inferenceservice import ServeSpec, served_models, server_args, smoke_test

pytestmark = pytest.mark.slow

KSERVE_OPENAI_ENV = "LLMFT_KSERVE_OPENAI_DIR"
"""Where kserve and its import-time dependencies are installed (default: ``<serving venv>/kserve-openai``)."""
SERVER = Path(__file__).with_name("kserve_openai_server.py")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))  # cluster_sim's FakeVllm
LORA = ServeSpec(
    name="demo-lora", pvc_name="data", adapter_path="runs/demo/adapter", lora_name="demo", base_model_path="base"
)
MERGED = ServeSpec(name="demo", pvc_name="data", adapter_path="runs/demo/adapter", lora_name="demo",
                   merged_model_path="merged/demo")  # fmt: skip
PROMPT = "Capital of France?"


@pytest.fixture(scope="module")
def kserve_openai(serving_venv) -> Path:
    where = Path(os.environ.get(KSERVE_OPENAI_ENV) or serving_venv / "kserve-openai")
    if not (where / "kserve" / "model_server.py").is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"no kserve at {where}: `make serving-venv` installs it (tools/build_serving_venv.sh)")
        pytest.skip(f"no kserve at {where}: build it with `make serving-venv`")
    return where


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 - loopback
            return answer.status, json.loads(answer.read())
    except OSError as exc:
        return getattr(exc, "code", 0), str(exc)


@pytest.fixture(scope="module")
def kserve_servers(serving_venv, kserve_openai, tmp_path_factory):
    """{"lora", "v0.15.0", "merged"}: KServe's server for the LoRA form's arguments, the same without the
    runtime's LoRA-name loop (KServe v0.15.0), and the merged form's arguments -> base URL."""
    logs = tmp_path_factory.mktemp("kserve-openai")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PYTHONPATH": str(kserve_openai), "VLLM_TARGET_DEVICE": "cpu"}
    configs = {
        "lora": {"args": server_args(LORA), "registers_lora_names": True},
        "v0.15.0": {"args": server_args(LORA), "registers_lora_names": False},
        "merged": {"args": server_args(MERGED), "registers_lora_names": True},
    }
    procs, urls = {}, {}
    try:
        for name, config in configs.items():
            port = _free_port()
            log = (logs / f"{name}.log").open("w")
            procs[name] = subprocess.Popen(
                [str(serving_venv / "bin" / "python"), str(SERVER), json.dumps({"port": port, **config})],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=logs,
            )  # fmt: skip
            urls[name] = f"http://127.0.0.1:{port}"
        for name, url in urls.items():
            _wait_until_listing(procs[name], url, logs / f"{name}.log")
        yield urls
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_until_listing(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 540.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"KServe's server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if _get(f"{url}/openai/v1/models")[0] == 200:
            return
        time.sleep(1)
    pytest.fail(f"KServe's server did not answer within {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")


def _listing(url: str) -> list[str]:
    status, body = _get(f"{url}/openai/v1/models")
    assert status == 200, body
    return [m["id"] for m in body["data"]]


def test_kserve_lists_the_base_name_once_per_registered_name_and_the_simulator_agrees(kserve_servers, tmp_path):
    from cluster_sim import FakeVllm

    base, _ = served_models(LORA)
    assert _listing(kserve_servers["lora"]) == [base, base]  # never the adapter's name
    assert _listing(kserve_servers["v0.15.0"]) == [base]
    assert _listing(kserve_servers["merged"]) == ["demo"]
    assert FakeVllm(server_args(LORA), tmp_path).listing() == [base, base]
    assert FakeVllm(server_args(LORA), tmp_path, registers_lora_names=False).listing() == [base]
    assert FakeVllm(server_args(MERGED), tmp_path).listing() == ["demo"]


def test_the_smoke_test_passes_against_kserves_listing(kserve_servers):
    """The base is listed; the adapter answers under its own name (KServe passes vLLM's answer through), and
    unlike the base."""
    base, adapter = served_models(LORA)
    out = smoke_test(kserve_servers["lora"], adapter, PROMPT, base_name=base, retry_wait_s=0)
    assert out["models"] == [base] and out["model"] == adapter
    assert (out["text"], out["base_text"]) == (" Paris.", " Lyon")


def test_the_smoke_test_fails_when_the_adapters_completion_is_the_bases(kserve_servers):
    from kserve_openai_server import UNCHANGED

    base, adapter = served_models(LORA)
    with pytest.raises(RuntimeError, match="answered exactly like the base model"):
        smoke_test(kserve_servers["lora"], adapter, f"{UNCHANGED} {PROMPT}", base_name=base, retry_wait_s=0)


def test_a_kserve_that_registers_no_lora_name_is_named(kserve_servers):
    base, adapter = served_models(LORA)
    with pytest.raises(RuntimeError, match=r"HTTP 404.*Model with name demo does not exist.*v0\.15\.1.*kserve#4345"):
        smoke_test(kserve_servers["v0.15.0"], adapter, PROMPT, base_name=base, retry_wait_s=0)


def test_the_merged_form_is_checked_by_its_one_name(kserve_servers):
    (name,) = served_models(MERGED)
    out = smoke_test(kserve_servers["merged"], name, PROMPT, base_name=None, retry_wait_s=0)
    assert out["models"] == [name] and out["base_text"] is None and out["text"] == " Lyon"
