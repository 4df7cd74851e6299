"""`llmft pipeline submit` prints the run's UI link (once, in its own words), `--wait` turns the run's end state into
the exit status, and `llmft pipeline wait RUN_ID` picks a run up again. The real kfp.Client talks to a loopback fake
of the KFP v2beta1 REST API (tests/pipeline/kfp_api_fake.py); the waiting loop itself is tested on a fake clock."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from fake_clock import FakeClock
from kfp_api_fake import RUN_ID, FakeKfpApi

from llmft.commands.pipeline_wait import RunFailed, RunLink, WaitStopped, run_url, wait_for_run
from llmft.trainer.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR

WAIT_QUICKLY = ("--wait", "--poll-interval", "0.05", "serving_deploy=false")
"""submit --wait polling the loopback fake every 50 ms; no deploy (nothing to deploy to)."""

LINK = RunLink(RUN_ID, f"https://kf.example.com/pipeline/#/runs/details/{RUN_ID}", "Wait again: llmft pipeline wait")


def _llmft(*args: str, home: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "llmft"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "llmft"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KF_PIPELINES")}
    environ.update(HOME=str(home), **(env or {}))  # HOME: no kfp context file of this machine
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=environ)


@pytest.mark.slow
def test_submit_prints_the_link_once_and_wait_exits_0_when_the_run_succeeds(tmp_path):
    with FakeKfpApi(["PENDING", "RUNNING", "RUNNING", "SUCCEEDED"]) as api:
        run = _llmft("pipeline", "submit", "--host", api.url, *WAIT_QUICKLY, home=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # no FutureWarning of kfp.Client, nothing else
    link = f"{api.url}/#/runs/details/{RUN_ID}"
    lines = run.stdout.splitlines()
    assert lines[0] == f"submitted run {RUN_ID} in experiment 'llm-finetune' on {api.url}"
    assert lines[1] == f"  run details: {link}"
    assert "Run details:" not in run.stdout and "Experiment details:" not in run.stdout  # kfp's own prints
    assert [line.split()[-1] for line in lines[3:6]] == ["PENDING", "RUNNING", "SUCCEEDED"]  # changes only
    assert lines[-1] == f"run {RUN_ID} SUCCEEDED: {link}"
    assert api.reads == 4 and ("GET", f"/apis/v2beta1/runs/{RUN_ID}") in api.requests


def _main(*args: str, capsys) -> tuple[int, str, str]:
    """In-process (the subprocess test above covers what the screen shows)."""
    from llmft.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_kfp_context(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no kfp context file of this machine
    monkeypatch.delenv("KF_PIPELINES_UI_ENDPOINT", raising=False)


@pytest.mark.slow
def test_a_failed_run_is_exit_1_naming_its_error_and_failed_task(no_kfp_context, capsys):
    with FakeKfpApi(
        ["RUNNING", "FAILED"],
        error="task train-model failed",
        failed_task=("train model", "PyTorchJob llmft-run-9 Failed: exit code 1 (bad config)"),
    ) as api:
        code, _out, err = _main("pipeline", "submit", "--host", api.url, *WAIT_QUICKLY, capsys=capsys)
    assert code == EXIT_USER_ERROR
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: run {RUN_ID} FAILED: task train-model failed; failed tasks: train model: ")
    assert "exit code 1 (bad config)" in err and f"Details: {api.url}/#/runs/details/{RUN_ID}" in err


@pytest.mark.slow
def test_wait_picks_a_run_up_again_and_a_canceled_run_is_not_a_success(no_kfp_context, capsys):
    with FakeKfpApi([503, "RUNNING", "CANCELED"]) as api:
        code, out, err = _main(
            "pipeline", "wait", RUN_ID, "--host", api.url, "--ui-host", "https://kf.example.com/pipeline",
            "--poll-interval", "0.05", capsys=capsys,
        )  # fmt: skip
    assert code == EXIT_USER_ERROR and f"run {RUN_ID} CANCELED" in err
    assert f"https://kf.example.com/pipeline/#/runs/details/{RUN_ID}" in out + err
    assert api.reads == 3  # the 503 was read again, not fatal


@pytest.mark.slow
def test_submit_without_wait_is_one_call_and_the_ui_endpoint_variable_sets_the_link(
    no_kfp_context, monkeypatch, capsys
):
    monkeypatch.setenv("KF_PIPELINES_UI_ENDPOINT", "https://ui.example.com")
    with FakeKfpApi(["RUNNING"]) as api:
        code, out, _err = _main("pipeline", "submit", "--host", api.url, "serving_deploy=false", capsys=capsys)
    assert code == 0 and api.reads == 0
    assert f"  run details: https://ui.example.com/#/runs/details/{RUN_ID}" in out.splitlines()


# --- the waiting loop, on a fake clock --------------------------------------------------------------------


def _reader(states: list, clock: FakeClock):
    def read(_run_id):
        state = states.pop(0) if len(states) > 1 else states[0]
        if isinstance(state, Exception):
            raise state
        return types.SimpleNamespace(state=state, error=None, run_details=None)

    return read


def test_the_state_is_printed_when_it_changes_and_success_returns_the_run():
    clock, said = FakeClock(), []
    states = ["PENDING", "RUNNING", "RUNNING", "RUNNING", "SUCCEEDED"]
    run = wait_for_run(_reader(states, clock), LINK, poll_s=30, clock=clock, sleep=clock.sleep, say=said.append)
    assert run.state == "SUCCEEDED"
    assert [line.split() for line in said[1:]] == [["0m00s", "PENDING"], ["0m30s", "RUNNING"], ["2m00s", "SUCCEEDED"]]


@pytest.mark.parametrize("end", ["FAILED", "CANCELED", "SKIPPED"])
def test_every_end_but_success_raises(end):
    clock = FakeClock()
    with pytest.raises(RunFailed, match=f"run {RUN_ID} {end}. Details: https://kf.example.com"):
        wait_for_run(_reader(["RUNNING", end], clock), LINK, clock=clock, sleep=clock.sleep, say=lambda _: None)


def test_the_timeout_stops_the_waiting_not_the_run():
    clock = FakeClock()
    read = _reader(["RUNNING"], clock)
    with pytest.raises(WaitStopped, match="still RUNNING after --timeout 600 s; run .* goes on: https.*Wait again"):
        wait_for_run(read, LINK, timeout_s=600, poll_s=10, clock=clock, sleep=clock.sleep, say=lambda _: None)
    assert WaitStopped("x").exit_code == EXIT_USER_ERROR  # never 200: a retrying caller would submit again


def test_reads_that_keep_failing_stop_the_waiting_but_a_few_are_retried():
    clock = FakeClock()
    flaky = [ConnectionError("reset")] * 3 + ["SUCCEEDED"]
    assert wait_for_run(_reader(flaky, clock), LINK, clock=clock, sleep=clock.sleep, say=lambda _: None)
    broken = [ConnectionError("refused")] * 20
    with pytest.raises(WaitStopped, match="could not be read 7 times in a row"):
        wait_for_run(_reader(broken, clock), LINK, clock=clock, sleep=clock.sleep, say=lambda _: None)


def test_ctrl_c_stops_the_waiting_with_the_link_and_exit_130():
    def interrupted(_seconds):
        raise KeyboardInterrupt

    clock = FakeClock()
    with pytest.raises(KeyboardInterrupt) as stopped:
        wait_for_run(_reader(["RUNNING"], clock), LINK, clock=clock, sleep=interrupted, say=lambda _: None)
    assert stopped.value.exit_code == EXIT_INTERRUPTED and "goes on: https://kf.example.com" in str(stopped.value)


def test_the_link_is_the_ui_page_of_the_run():
    assert run_url("https://kf.example.com/pipeline/", "r1") == "https://kf.example.com/pipeline/#/runs/details/r1"
    assert run_url("localhost:8080", "r1") == "https://localhost:8080/#/runs/details/r1"
