"""`llmft pipeline run-local` as an operator meets it (issues 44 and 45): the running task's latest progress line
on the screen, one run per work folder, and SIGTERM passed on to the running task (exit 143, nothing orphaned)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmft.cli import main as llmft_main
from llmft.pipelines.local_run import ProgressStream
from llmft.pipelines.local_stop import LOCK_FILE, descendants, work_folder_lock
from llmft.trainer.progress import Progress

PROGRESS = Progress(step=2, total=6, elapsed_s=100.0, eta_s=200.0, tokens_per_s=48.0, loss=1.25).line()


class Screen(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _stream(tty: bool) -> tuple[ProgressStream, Screen]:
    screen = Screen(tty)
    return ProgressStream(io.StringIO(), screen), screen


def test_the_screen_shows_the_running_tasks_progress_lines_with_total_and_eta():
    stream, screen = _stream(tty=False)
    stream.write("01:02:03.000 - INFO - Executing task \x1b[96m'train-model'\x1b[0m\n")
    stream.write("training: llmft train --nproc 1 ...\nstep=2 loss=1.25 lr=0.002\n")
    stream.write(f"{PROGRESS}\n")
    stream.write("01:05:00.000 - INFO - Task 'train-model' finished with status \x1b[92mSUCCESS\x1b[0m\n")
    shown = screen.getvalue().splitlines()
    assert shown[0] == "  train-model                step 2/6 (33%), 48 tokens/s, loss 1.25, elapsed 1m40s, ETA 3m20s"
    assert shown[1].startswith("  train-model                SUCCESS") and len(shown) == 2  # no other task output
    assert stream.latest_progress.startswith("train-model")


def test_on_a_terminal_the_progress_line_is_redrawn_in_place():
    stream, screen = _stream(tty=True)
    stream.write("Executing task 'train-model'\n")
    stream.write(f"{PROGRESS}\n{PROGRESS.replace('step 2/6 (33%)', 'step 3/6 (50%)')}\n")
    stream.write("Task 'train-model' finished with status SUCCESS\n")
    text = screen.getvalue()
    assert text.count("\x1b[2K") == 3 and text.count("\r") == 3  # running ..., two redraws; then the line
    assert text.endswith("SUCCESS ") is False and "step 3/6 (50%)" in text and text.endswith(" s\n")


def test_a_second_run_on_the_same_work_folder_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """Issue 45: two run-locals on a fresh work folder raced on creating its MLflow store and the second died with
    exit 3 on sqlite's "_alembic_tmp_experiments already exists". One run holds the folder; the other stops at once.
    (flock locks of two open files conflict within one process too: the holder here is this test.)"""
    ran = []
    monkeypatch.setattr("llmft.pipelines.local_run._run_locked", lambda *a, **k: ran.append(a))
    with work_folder_lock(tmp_path):
        assert llmft_main(["pipeline", "run-local", "--tiny", "--work-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert not ran and err.count("\n") == 1
    assert f"work folder {tmp_path} is in use by another `llmft pipeline run-local` (pid {os.getpid()}" in err
    assert "pass --work-dir" in err
    with work_folder_lock(tmp_path):  # released: the next run takes it
        assert (tmp_path / LOCK_FILE).is_file()


def _wait_for(path: Path, needle: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and needle in path.read_text(errors="replace"):
            return
        assert process.poll() is None, f"run-local ended early ({process.returncode})"
        time.sleep(1.0)
    pytest.fail(f"{needle!r} not in {path} after {timeout_s} s")


@pytest.mark.slow
def test_sigterm_stops_the_running_task_exits_143_and_leaves_no_process(tmp_path, tiny_model_dir):
    """Issue 45: SIGTERM to run-local killed it at once and orphaned its tasks: the trainer, reparented to init,
    went on training and committed a checkpoint afterwards. Now the signal goes to the running task: the
    trainer commits a checkpoint and exits 143, run-local waits for it and exits 143 with one line."""
    work = tmp_path / "work"
    command = [sys.executable, "-m", "llmft", "pipeline", "run-local", "--tiny", "--work-dir", str(work),
               f"model={tiny_model_dir}", "max_steps=400", "train_overrides=save_every=0 eval_every=0 log_every=1 "
               "batch.global_sequences=4 observe.progress_bar=false"]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(work / "run-local.log", "progress: step", run, timeout_s=600)
        below = set(descendants(run.pid))
        assert below, "the train task runs below run-local"
        os.kill(run.pid, signal.SIGTERM)
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM (full log: ")
    assert "pipeline STOPPED by SIGTERM" in out and "task train-model was stopped" in out
    alive = [pid for pid in below if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]
    assert alive == [], f"processes left running: {alive}"
    log = (work / "run-local.log").read_text(errors="replace")
    assert "SIGTERM: checkpoint step-" in log and "committed; exiting 143" in log  # the trainer's own stop
    runs = list((work / "data" / "runs").iterdir())
    checkpoints = sorted(p.name for p in runs[0].glob("checkpoints/step-*"))
    time.sleep(3)
    assert sorted(p.name for p in runs[0].glob("checkpoints/step-*")) == checkpoints  # nothing trains afterwards


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "Z"
    return stat[stat.rfind(")") + 2 :].split()[0]


@pytest.mark.slow
def test_a_run_without_mlflow_whose_gate_refuses_is_green_with_the_reason(tmp_path, tiny_model_dir):
    """Issues 44 items 2 and 3 through the command a user types: no MLflow server anywhere (an empty
    mlflow_tracking_uri, no MLFLOW_TRACKING_URI), a gate the tiny model cannot pass (held-out contains). The run
    completes and exits 0; the screen shows the train task's progress lines, the decision and its reason."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    work = tmp_path / "work"
    run = subprocess.run(
        [sys.executable, "-m", "llmft", "pipeline", "run-local", "--tiny", "--work-dir", str(work),
         f"model={tiny_model_dir}", "max_steps=8", "mlflow_tracking_uri=", "promote_metric=heldout.contains",
         "eval_max_questions=2"],
        env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "SUCCEEDED (not promoted)" in out and "gate        not promoted: best checkpoint step-8 has" in out
    assert "mlflow      not registered: not promoted" in out and "deploy      skipped: not promoted" in out
    progress = [line for line in out.splitlines() if line.startswith("  train-model ") and " ETA " in line]
    assert progress and "step 8/8 (100%)" in progress[-1], out[-3000:]
    assert "summarize-not-promoted     SUCCESS" in out and "register-model" not in out
    log = (work / "run-local.log").read_text(errors="replace")
    assert "mlflow: off, nothing will be tracked or registered" in log
    assert not (work / "mlflow.db").exists() and not list(work.rglob("mlruns"))  # nothing wrote an MLflow store
