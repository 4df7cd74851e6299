"""MLflow (a real SQLite-backed tracking store, parent/child runs) and Langfuse (its real
client against a loopback HTTP endpoint that records what it receives)."""

from __future__ import annotations

import gzip
import http.server
import json
import threading

import pytest
from llmft.trainer.observe import SpeedMeter, send_langfuse_trace, summary_screen
from trainer_helpers import events, train_in_process


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


def test_trainer_mfu_is_the_benchmarks_flop_formula(base_overrides, tiny_model_dir, tokenized_dir, tmp_path):
    """Every logged MFU is trainer/fastpath/flops.py's step_flops (what the benchmark counts) for that
    step's documents, over the step's time, against the configured peak."""
    from llmft.trainer.data.loader import PackedLoader
    from llmft.trainer.fastpath import flops
    from transformers import AutoConfig

    peak_tflops = 1e-3
    code, _ = train_in_process(base_overrides("mfu", max_steps=3, observe__peak_tflops=peak_tflops))
    assert code == 0
    shape = flops.shape_from_config(AutoConfig.from_pretrained(tiny_model_dir))
    loader = PackedLoader(tokenized_dir, "train", global_sequences=4, micro_sequences=2, rank=0, world_size=1, seed=3)
    seen = 0
    for event in events(tmp_path / "mfu", "train"):
        step_tokens, seen = event["tokens_seen"] - seen, event["tokens_seen"]
        lengths = loader.batch(event["step"]).global_doc_lengths
        assert step_tokens == int(lengths.sum())
        expected = flops.step_flops(shape, "lora", lengths, 4, flops.ALL_LINEAR) / (step_tokens / event["tokens_per_s"])
        assert event["mfu"] == pytest.approx(expected / (peak_tflops * 1e12), rel=1e-9)
    manifest = json.loads((tmp_path / "mfu" / "final" / "training_manifest.json").read_text())
    assert manifest["speed"]["mfu"] > 0 and manifest["speed"]["steady_steps"] == 1


def test_speed_meter_excludes_load_warmup_and_pauses():
    """A fake clock: 10 s of loading, a 5 s first step (compilation), then 0.5 s steps with a 2 s
    evaluation between them. Steady tokens/s and MFU see only the 0.5 s steps."""
    now = [0.0]
    meter = SpeedMeter(None, peak=1000.0, world_size=2, clock=lambda: now[0])
    now[0] = 10.0
    meter.loaded()
    for seconds in (5.0, 1.0, 0.5, 0.5, 0.5):
        now[0] += seconds
        meter.step(tokens=1000, flops=400.0)
        if meter.steps == 3:
            with meter.pause():
                now[0] += 2.0
    report = meter.report()
    assert report["load_s"] == 10.0 and report["warmup_s"] == 6.0 and report["eval_and_save_s"] == 2.0
    assert report["steady_steps"] == 3 and report["steady_s"] == pytest.approx(1.5)
    assert report["tokens_per_s"] == pytest.approx(3000 / 1.5) and report["tokens_per_s_per_device"] == 1000
    assert report["mfu"] == pytest.approx(1200 / 1.5 / (1000.0 * 2))
    screen = summary_screen({"status": "finished", "final_metrics": {"eval_loss": 1.0}, "speed": report})
    assert "=" * 64 in screen and "final eval loss" in screen
    assert "2,000 (steady state: the last 3 steps" in screen and "10.0 s" in screen and "40.0%" in screen
    short = SpeedMeter(None, peak=None, world_size=1, clock=lambda: now[0])
    short.loaded()
    now[0] += 1.0
    short.step(tokens=10, flops=None)
    assert short.report()["steady_state"] is False and short.report()["tokens_per_s"] == pytest.approx(10.0)
    assert "too few for a steady state" in summary_screen({"speed": short.report()})
