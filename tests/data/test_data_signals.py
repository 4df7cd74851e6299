"""`llmft data prepare` stopped by SIGTERM or Ctrl-C at any moment, its worker pool starting,
running or stopping: exit 143 or 130 in one line, no temporary folder, no worker left, no hang.

The prepare runs as its own session (as a pod's PID 1 or a terminal job would), so every process
it forked is found by session id, dead parent or not. docs/failure-modes.md has a row per test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from llmft.trainer.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

ROWS = 60_000
EXIT_BOUND_S = 10.0  # generous: a clean stop takes well under a second; the bug was a hang of minutes
# When to signal, as fractions of one whole prepare on this machine (from llmft's SIGTERM handler to its exit):
# the pool starting (the hang was there), reading, writing and stopping, however fast or loaded the machine is.
DELAY_FRACTIONS = (0.02, 0.08, 0.15, 0.25, 0.35, 0.5, 0.65, 0.8, 0.92)


@pytest.fixture(scope="module")
def big_jsonl(tmp_path_factory) -> Path:
    """60,000 generated chat rows (about 30 MB: above the size at which prepare starts a worker pool)."""
    path = tmp_path_factory.mktemp("signals") / "rows.jsonl"
    pad = "lorem ipsum dolor sit amet " * 14
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(ROWS):
            row = {
                "messages": [{"role": "user", "content": f"Q{i}? {pad}"}, {"role": "assistant", "content": f"A{i}."}]
            }
            fh.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def prepare_seconds(big_jsonl, tmp_path_factory) -> float:
    """How long one prepare of ``big_jsonl`` runs here, from llmft's start (its SIGTERM handler) to its exit."""
    out = tmp_path_factory.mktemp("timed") / "out"
    script = Path(sys.executable).parent / "llmft"
    proc = subprocess.Popen(
        [str(script), "data", "prepare", "--input", str(big_jsonl), "--output", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for_sigterm_handler(proc)
    started = time.monotonic()
    assert proc.wait(timeout=600) == 0
    return time.monotonic() - started


def _session_alive(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    alive = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields after the name: state ppid pgrp session
            alive.append(int(stat_file.parent.name))
    return alive


def _default_stop_signals() -> None:
    """In the child: SIGINT and SIGTERM at their default dispositions. A shell starts a background job with SIGINT
    ignored, and Python then leaves it ignored: a Ctrl-C could never land (CI ran the suite that way)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _wait_for_sigterm_handler(proc: subprocess.Popen, bound_s: float = 120.0) -> None:
    """Until ``proc`` catches SIGTERM (its SigCgt mask in /proc: llmft's handler is installed), or it exits."""
    deadline = time.monotonic() + bound_s
    bit = 1 << (signal.SIGTERM - 1)
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            return
        caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
        if int(caught, 16) & bit:
            return
        time.sleep(0.01)


class Outcome(NamedTuple):
    code: int | None  # None: no exit within EXIT_BOUND_S (a hang)
    err: str
    running: bool  # still running when signalled (else the run had finished first)
    leftovers: list[int]  # live processes of its session after it exited


def _stop_prepare(tmp_path: Path, rows: Path, signum: int, delay: float) -> Outcome:
    """Start a prepare, send ``signum`` after ``delay`` s, wait for it; the session is killed afterwards."""
    script = Path(sys.executable).parent / "llmft"
    command = [str(script), "data", "prepare", "--input", str(rows), "--output", str(tmp_path / "out")]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_stop_signals,  # as from a terminal, even when this test runs in a background job
    )
    try:
        _wait_for_sigterm_handler(proc)  # the delays count from llmft's start, not the interpreter's (load-proof)
        time.sleep(delay)
        running = proc.poll() is None
        try:
            if signum == signal.SIGINT:
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
            else:
                proc.send_signal(signum)  # the kubelet signals the container's main process only
        except ProcessLookupError:  # it ended between the poll and the signal
            running = False
        try:
            _out, err = proc.communicate(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            return Outcome(None, "", running, [])
        deadline = time.monotonic() + 5  # a worker killed as its parent exits gets a moment to go
        while _session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return Outcome(proc.returncode, err, running, _session_alive(proc.pid))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=30)


def _assert_every_delay_stops_cleanly(
    tmp_path: Path, rows: Path, seconds: float, signum: int, code: int, needle: str
) -> None:
    """At every delay: a clean stop, or a complete output where the run had finished before the signal."""
    landed = 0
    for fraction in DELAY_FRACTIONS:
        delay = round(fraction * seconds, 3)
        result = _stop_prepare(tmp_path, rows, signum, delay)
        where = f"{signal.Signals(signum).name} {delay} s in (of {seconds:.2f} s)"
        assert result.code is not None, f"{where}: no exit within {EXIT_BOUND_S} s (hung)"
        assert not result.leftovers, f"{where}: processes left behind: {result.leftovers}"
        temp = list(tmp_path.glob(".out.*"))
        assert not temp, f"{where}: temporary output left: {temp}"
        if result.running and result.code == -signum:  # came while the interpreter started, before llmft ran:
            assert "error: " not in result.err, (where, result.err)  # the default action; shells and the kubelet
            continue  # report 128 + signal, the same code, and nothing had been written
        if result.running and result.code != 0:
            landed += 1
            assert result.code == code, (where, result.code, result.err)
            assert "Traceback" not in result.err, (where, result.err)
            errors = [line for line in result.err.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1 and needle in errors[0], (where, result.err)
            assert not (tmp_path / "out").exists(), where
        else:  # the run finished before the signal: its output is complete
            assert result.code == 0, (where, result.code, result.err)
            assert (tmp_path / "out" / "report.json").is_file(), where
            shutil.rmtree(tmp_path / "out")
    assert landed >= len(DELAY_FRACTIONS) // 2, f"only {landed} signals came while the prepare ran"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_at_any_moment_of_prepare_exits_143_with_nothing_left(tmp_path, big_jsonl, prepare_seconds):
    _assert_every_delay_stops_cleanly(
        tmp_path, big_jsonl, prepare_seconds, signal.SIGTERM, EXIT_PREEMPTED, "stopped by SIGTERM"
    )


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_at_any_moment_of_prepare_exits_130_with_nothing_left(tmp_path, big_jsonl, prepare_seconds):
    _assert_every_delay_stops_cleanly(
        tmp_path, big_jsonl, prepare_seconds, signal.SIGINT, EXIT_INTERRUPTED, "interrupted"
    )
