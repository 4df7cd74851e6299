"""Kubeflow Trainer's progress API (issue 44 item 1): rank 0 posts progress, ETA and metrics to the TrainJob status
server the TrainJobStatus plugin names, over HTTPS with the projected token, in the payload upstream decodes
(tests/trainjob_status_server.py encodes kubeflow/trainer v2.3.0's handler)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmft.trainer.progress import Progress
from llmft.trainer.trainer_status import CA_CERT_ENV, MAX_TEXT, TOKEN_ENV, URL_ENV, StatusReporter, status_body

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainjob_status_server import StatusServer, go_decode, make_certificates, trainer_status_schema  # noqa: E402

NOW = datetime.datetime(2030, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)  # a value to format, never compared to the clock


def test_the_body_is_the_update_request_upstream_decodes(crd_dir):
    body = status_body(
        Progress(step=45, total=100, elapsed_s=10.0, eta_s=3599.6),
        {"loss": 0.15, "learning_rate": 2e-4, "bad": float("nan"), "x" * 80: 1.0, "flag": True},
        NOW,
    )
    status = body["trainerStatus"]
    assert status["progressPercentage"] == 45 and status["estimatedRemainingSeconds"] == 3600
    assert status["lastUpdatedTime"] == "2030-05-06T07:08:09Z"
    assert {"name": "loss", "value": "0.15"} in status["metrics"]
    assert {"name": "learning_rate", "value": "0.0002"} in status["metrics"]
    names = [m["name"] for m in status["metrics"]]
    assert "bad" not in names and "flag" not in names and "x" * MAX_TEXT in names  # finite numbers; names cut to 64
    import json

    decoded = go_decode(json.dumps(body).encode())
    assert decoded == body  # every field survives Go's decoder as sent
    server = StatusServer.__new__(StatusServer)
    server.schema = trainer_status_schema(crd_dir)
    assert server.validate(decoded) == []  # and the CRD's schema and CEL rule


def test_no_eta_before_the_first_step_and_the_percentage_stays_in_range():
    early = status_body(Progress(step=0, total=7, elapsed_s=1.0, eta_s=None), {}, NOW)["trainerStatus"]
    assert early == {"progressPercentage": 0, "lastUpdatedTime": "2030-05-06T07:08:09Z"}  # no metrics: none sent
    done = status_body(Progress(step=9, total=7, elapsed_s=1.0, eta_s=0.0), {}, NOW)["trainerStatus"]
    assert done["progressPercentage"] == 100 and done["estimatedRemainingSeconds"] == 0
    assert status_body(Progress(2, 3, 1.0, 1.0), {}, NOW)["trainerStatus"]["progressPercentage"] == 66  # floor


def test_without_the_plugins_variables_nothing_reports():
    assert StatusReporter.from_env({}) is None
    assert StatusReporter.from_env({URL_ENV: "https://x/status"}) is None  # no token path: not a TrainJob pod


@pytest.fixture
def status_server(tmp_path, crd_dir):
    ca, cert, key = make_certificates(tmp_path)
    token = tmp_path / "token"
    token.write_text("projected-token-1\n")
    with StatusServer(cert, key, "projected-token-1", trainer_status_schema(crd_dir)) as server:
        server.env = {URL_ENV: server.url, CA_CERT_ENV: str(ca), TOKEN_ENV: str(token)}
        server.token_path = token
        yield server


@pytest.mark.slow
def test_the_reporter_posts_the_latest_status_at_most_every_interval_and_the_last_one_at_close(status_server):
    reporter = StatusReporter.from_env(status_server.env)
    assert reporter is not None
    reporter.min_interval_s = 0.5
    for step in range(1, 21):  # 20 reports in well under one interval each: latest wins
        reporter.report(Progress(step, 20, float(step), 20.0 - step, loss=1.0 / step), {"loss": 1.0 / step})
        time.sleep(0.01)
    reporter.close()
    sent = [r["trainerStatus"]["progressPercentage"] for r in status_server.accepted]
    assert status_server.refused == [] and reporter.failures == 0
    assert 1 <= len(sent) <= 3 and sent[-1] == 100, sent  # throttled, and the final one went out
    assert status_server.accepted[-1]["trainerStatus"]["estimatedRemainingSeconds"] == 0


@pytest.mark.slow
def test_a_refused_or_unreachable_server_costs_a_warning_never_the_training(status_server, caplog):
    status_server.token_path.write_text("a-token-of-another-trainjob")  # rotated to one the server refuses
    reporter = StatusReporter.from_env(status_server.env)
    reporter.report(Progress(1, 2, 1.0, 1.0), {})
    reporter.close()
    assert status_server.refused == [(403, "Forbidden")] and reporter.failures == 1 and reporter.sent == 0
    assert "TrainJob progress not reported" in caplog.text and "403" in caplog.text
    status_server.token_path.write_text("projected-token-1")  # the token is re-read for every post
    dead = StatusReporter("https://127.0.0.1:9/status", str(status_server.token_path), None, min_interval_s=0)
    started = time.monotonic()
    dead.report(Progress(1, 2, 1.0, 1.0), {})  # returns at once: the post is on the reporter's thread
    assert time.monotonic() - started < 0.5
    dead.close()
    assert dead.failures == 1


@pytest.mark.slow
def test_the_trainer_reports_its_progress_to_the_trainjob_status_server(status_server, base_overrides, tmp_path):
    """The real trainer (tiny model, 4 steps) in a pod the TrainJobStatus plugin prepared: rank 0 reports, the
    server accepts every post, the last one says 100% with the loss and eval metrics."""
    env = {**os.environ, **status_server.env, "PYTHONUNBUFFERED": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    run = subprocess.run(
        [sys.executable, "-m", "llmft.trainer", *base_overrides(eval_every=2)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert status_server.refused == [], status_server.refused
    last = status_server.accepted[-1]["trainerStatus"]
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    names = {m["name"] for m in last["metrics"]}
    assert {"loss", "learning_rate", "grad_norm", "eval_loss", "perplexity"} <= names
    assert "reporting to the TrainJob's status" in run.stdout
