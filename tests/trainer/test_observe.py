"""MLflow (a real SQLite-backed tracking store, parent/child runs; a dead server), the unconfigured
sinks, speed and MFU. The live Langfuse trace is tested in test_langfuse_trace.py."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest
from trainer_helpers import events, train_in_process

from llmft.trainer.mlflow_settings import PARENT_RUN_ENV
from llmft.trainer.observe import SpeedMeter, summary_screen


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ARTIFACT_URI", str(tmp_path / "artifacts"))
    yield uri
    import mlflow

    while mlflow.active_run():
        mlflow.end_run()


@pytest.mark.slow
def test_mlflow_child_run_gets_params_metrics_and_final_artifacts(base_overrides, mlflow_uri, monkeypatch, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(mlflow_uri)
    experiment = mlflow.create_experiment("sweep", artifact_location=str(tmp_path / "artifacts"))
    parent = MlflowClient(mlflow_uri).create_run(experiment).info.run_id
    monkeypatch.setenv(PARENT_RUN_ENV, parent)
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


def test_a_dead_mlflow_server_costs_seconds_not_minutes(base_overrides, monkeypatch, capsys):
    """MLFLOW_TRACKING_URI naming a port nobody listens on: the observer asks once, within
    CONNECT_TIMEOUT_S, says so in one line and trains without MLflow. Without the check, MLflow's
    client retried 7 times with backoff (about 4 minutes) before the first metric."""
    from llmft.trainer.config_load import load_config
    from llmft.trainer.mlflow_settings import CONNECT_TIMEOUT_S, HTTP_SETTINGS
    from llmft.trainer.observe import Observer

    with socket.socket() as sock:  # a port that was free a moment ago: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    for name in (*HTTP_SETTINGS, "LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "mlflow", None)  # any `import mlflow` now fails loudly
    cfg = load_config(None, base_overrides("dead-mlflow"))
    started = time.monotonic()
    observer = Observer(cfg, {}, is_main=True, total_steps=1, start_step=0)
    elapsed = time.monotonic() - started
    out = capsys.readouterr().out
    assert f"MLflow tracking server http://127.0.0.1:{port} is unreachable" in out and "not logging to MLflow" in out
    assert observer._mlflow_ok is False and observer.mlflow_run_id is None
    assert elapsed < CONNECT_TIMEOUT_S  # one refused connection, no retries
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == HTTP_SETTINGS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    observer.log_train(1, {"loss": 1.0})  # training goes on without MLflow
    observer.finish({}, None)


@pytest.mark.slow
def test_langfuse_and_mlflow_unconfigured_are_single_info_lines(base_overrides, monkeypatch):
    for name in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    code, stdout = train_in_process(base_overrides("quiet", max_steps=1))
    assert code == 0
    lines = stdout.splitlines()
    assert [line for line in lines if line.startswith("[llmft] langfuse")] == [
        "[llmft] langfuse: LANGFUSE_PUBLIC_KEY/LANGFUSE_SECRET_KEY not set, no trace"
    ]
    assert [line for line in lines if line.startswith("[llmft] mlflow")] == [
        "[llmft] mlflow: MLFLOW_TRACKING_URI not set, not logging to MLflow"
    ]


@pytest.mark.slow
def test_trainer_mfu_is_the_benchmarks_flop_formula(base_overrides, tiny_model_dir, tokenized_dir, tmp_path):
    """Every logged MFU is llmft/trainer/flops.py's step_flops (what the benchmark counts) for that
    step's documents, over the step's time, against the configured peak."""
    from transformers import AutoConfig

    from llmft.trainer import flops
    from llmft.trainer.data.loader import PackedLoader

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


def test_speed_meter_excludes_load_warmup_recompiles_and_pauses():
    """A fake clock and a fake compile counter: 10 s of loading, a 5 s first step (compilation),
    0.5 s steps with a 2 s evaluation between two of them, and one 20 s step that recompiled for a
    new packed shape (what a short GPU run showed: the recompile dominated its "steady" figure).
    Steady tokens/s and MFU see only the plain 0.5 s steps."""
    now, graphs = [0.0], [0]
    meter = SpeedMeter(None, peak=1000.0, world_size=2, clock=lambda: now[0], compiled=lambda: graphs[0])
    now[0] = 10.0
    meter.loaded()
    for seconds, compiles in ((5.0, 1), (1.0, 0), (0.5, 0), (20.0, 1), (0.5, 0), (0.5, 0)):
        now[0] += seconds
        graphs[0] += compiles
        meter.step(tokens=1000, flops=400.0)
        if meter.steps == 3:
            with meter.pause():
                now[0] += 2.0
    report = meter.report()
    assert report["load_s"] == 10.0 and report["eval_and_save_s"] == 2.0
    assert report["warmup_s"] == 26.0 and report["warmup_steps"] == 3 and report["recompile_steps"] == 1
    assert report["steady_steps"] == 3 and report["steady_s"] == pytest.approx(1.5)
    assert report["tokens_per_s"] == pytest.approx(3000 / 1.5) and report["tokens_per_s_per_device"] == 1000
    assert report["mfu"] == pytest.approx(1200 / 1.5 / (1000.0 * 2))
    screen = summary_screen({"status": "finished", "final_metrics": {"eval_loss": 1.0}, "speed": report})
    assert "=" * 64 in screen and "final eval loss" in screen
    assert "2,000 (steady state: 3 steps" in screen and "10.0 s" in screen and "40.0%" in screen
    assert "1 step(s) that recompiled" in screen
    short = SpeedMeter(None, peak=None, world_size=1, clock=lambda: now[0], compiled=lambda: 0)
    short.loaded()
    now[0] += 1.0
    short.step(tokens=10, flops=None)
    assert short.report()["steady_state"] is False and short.report()["tokens_per_s"] == pytest.approx(10.0)
    assert "too few for a steady state" in summary_screen({"speed": short.report()})


def test_the_load_peak_is_reported_apart_and_training_starts_a_fresh_peak(monkeypatch):
    """Issue 37 item 4: a 4-bit MoE base peaks while it is built (bf16 experts before quantization); the train
    records' peak must be training's own. SpeedMeter.loaded() keeps the load peak and resets the counter."""
    import torch

    from llmft.trainer import observe

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 56.4 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(device))
    device = torch.device("cuda", 0)
    meter = SpeedMeter(device, peak=None, world_size=1, clock=lambda: 0.0, compiled=lambda: 0)
    meter.loaded()
    assert calls == [device] and meter.report()["load_peak_gib"] == pytest.approx(56.4)
    assert observe.restart_peak_memory(torch.device("cpu")) is None and calls == [device]
