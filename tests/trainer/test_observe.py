"""MLflow (a real SQLite-backed tracking store, parent/child runs) and Langfuse (its real
client against a loopback HTTP endpoint that records what it receives)."""

from __future__ import annotations

import gzip
import http.server
import json
import threading

import pytest
from llmft.trainer.observe import send_langfuse_trace, summary_screen, train_flops
from trainer_helpers import train_in_process


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ARTIFACT_URI", str(tmp_path / "artifacts"))
    yield uri
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()


def test_mlflow_child_run_gets_params_metrics_and_final_artifacts(base_overrides, mlflow_uri, monkeypatch, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(mlflow_uri)
    experiment = mlflow.create_experiment("sweep", artifact_location=str(tmp_path / "artifacts"))
    parent = MlflowClient(mlflow_uri).create_run(experiment).info.run_id
    monkeypatch.setenv("LLMFT_MLFLOW_PARENT_RUN_ID", parent)
    code, stdout = train_in_process(
        base_overrides("tracked", max_steps=2, eval_every=1, observe__mlflow_experiment="sweep")
    )
    assert code == 0 and "mlflow: logging to run" in stdout
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert run.info.status == "FINISHED"
    assert run.data.params["lora.r"] == "4" and run.data.params["method"] == "lora"
    history = client.get_metric_history(run.info.run_id, "eval/eval_loss")
    assert [m.step for m in history] == [1, 2]
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 2
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "final")}
    assert {"final/adapter_model.safetensors", "final/training_manifest.json"} <= artifacts
    manifest = json.loads((tmp_path / "tracked" / "final" / "training_manifest.json").read_text())
    assert manifest["mlflow_run_id"] == run.info.run_id


class _Recorder(http.server.BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802 - http.server API
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if body[:2] == b"\x1f\x8b":  # OTLP exports are gzip-compressed
            body = gzip.decompress(body)
        type(self).received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_langfuse_sends_one_trace_with_scores(monkeypatch, capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Recorder.received = []
    try:
        monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
        monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
        monkeypatch.setenv("LANGFUSE_HOST", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("LANGFUSE_BASE_URL", f"http://127.0.0.1:{server.server_port}")
        summary = {"final_metrics": {"eval_loss": 1.25, "perplexity": 3.49}, "steps": 7, "config": {"method": "lora"}}
        assert send_langfuse_trace("run-xyz", summary) is True
    finally:
        server.shutdown()
    blob = b"".join(body for _, body in _Recorder.received)
    assert b"llmft-train run-xyz" in blob  # the trace's span
    assert b"eval_loss" in blob and b"perplexity" in blob  # its scores
    assert any("otel" in path or "ingestion" in path for path, _ in _Recorder.received)


def test_langfuse_and_mlflow_unconfigured_are_single_info_lines(monkeypatch, capsys):
    for name in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert send_langfuse_trace("r", {}) is False
    assert capsys.readouterr().out.count("\n") == 1


def test_flops_count_4n_for_lora_6n_for_full_plus_attention():
    lora = train_flops(
        method="lora", matmul_params=1000, adapter_params=10, tokens=100, layers=2, attn_width=8, attn_sq=50 * 50 * 2
    )
    full = train_flops(
        method="full", matmul_params=1000, adapter_params=0, tokens=100, layers=2, attn_width=8, attn_sq=50 * 50 * 2
    )
    attention = 6 * 2 * 8 * 5000
    assert lora == 4 * 1000 * 100 + 6 * 10 * 100 + attention
    assert full == 6 * 1000 * 100 + attention
    screen = summary_screen({"status": "finished", "final_metrics": {"eval_loss": 1.0}})
    assert "=" * 64 in screen and "final eval loss" in screen
