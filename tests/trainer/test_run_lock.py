"""One run per output_dir (issue 27.4; llmft/trainer/runlock.py): a second run into a busy directory exits 1
naming the holder, `--wait` waits for it, a holder that died without releasing is taken over on the
same host and refused from another, and the lock goes with the process however it ends.
docs/failure-modes.md has a row per test."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_helpers import REPO, clean_env

from llmft.trainer import runlock
from llmft.trainer.errors import EXIT_PREEMPTED, EXIT_USER_ERROR

LLMFT = [str(Path(sys.executable).parent / "llmft")]


def _start(overrides: list[str], log: Path, *extra: str) -> subprocess.Popen:
    with open(log, "w") as fh:  # a file, not a pipe: a long run must never block on a full pipe
        return subprocess.Popen(
            [*LLMFT, "train", *extra, *overrides], cwd=REPO, env=clean_env(), stdout=fh, stderr=subprocess.STDOUT
        )


def _wait_for(condition, proc: subprocess.Popen, log: Path, what: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    pytest.fail(f"no {what} within {seconds} s:\n{log.read_text()[-3000:]}")


def _holder(out: Path) -> dict | None:
    try:
        text = (out / runlock.LOCK_FILE).read_text()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_two_runs_into_one_output_dir_never_mix(base_overrides, tmp_path):
    out = tmp_path / "run"
    overrides = base_overrides("run", max_steps=100_000, log_every=50)  # runs until stopped
    first = _start(overrides, tmp_path / "first.log")
    waiting = None
    try:
        _wait_for(lambda: (out / "metrics.jsonl").is_file(), first, tmp_path / "first.log", "training")
        second = subprocess.run(
            [*LLMFT, "train", *overrides], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120
        )
        assert second.returncode == EXIT_USER_ERROR, second.stdout[-2000:] + second.stderr[-2000:]
        (line,) = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
        assert f"pid {first.pid} on host {socket.gethostname()}" in line and "--wait" in line, line
        assert "Traceback" not in second.stderr
        assert first.poll() is None, "the running run was disturbed"
        assert _holder(out)["pid"] == first.pid
        assert json.loads((out / "restarts.json").read_text())["pid"] == first.pid  # the second claimed nothing

        waiting = _start(overrides, tmp_path / "waiting.log", "--wait")
        log = tmp_path / "waiting.log"
        _wait_for(lambda: "waiting for it to end" in log.read_text(), waiting, log, "waiting line")
        first.send_signal(signal.SIGKILL)  # dies without releasing anything but the flock
        assert first.wait(timeout=60) == -signal.SIGKILL
        _wait_for(lambda: (_holder(out) or {}).get("pid") == waiting.pid, waiting, log, "take-over")
        assert f"took over the lock of output_dir={out} from pid {first.pid}" in log.read_text()
        _wait_for(lambda: "step" in log.read_text().split("took over", 1)[1], waiting, log, "training")
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=180) == EXIT_PREEMPTED, log.read_text()[-3000:]
        assert _holder(out) is None, "a run stopped by SIGTERM releases its lock and clears its record"
    finally:
        for proc in (first, waiting):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


def _write_holder(out: Path, **record) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / runlock.LOCK_FILE
    path.write_text(json.dumps(record))
    return path


def test_a_leftover_lock_is_taken_over_on_this_host_and_refused_from_another(tmp_path):
    said: list[str] = []
    gone = {"pid": 2**22 + 17, "host": socket.gethostname(), "boot_id": runlock._boot_id(), "start": 1, "since": "x"}
    _write_holder(tmp_path / "dead", **gone)
    lock = runlock.acquire(tmp_path / "dead", say=said.append)
    assert len(said) == 1 and "took over" in said[0] and f"pid {gone['pid']}" in said[0]
    assert _holder(tmp_path / "dead")["pid"] == os.getpid()
    lock.release()
    assert _holder(tmp_path / "dead") is None

    path = _write_holder(tmp_path / "other", pid=7, host="node-b", boot_id="b", start=1, since="x")
    with pytest.raises(runlock.OutputDirInUseError, match="pid 7 on host node-b") as refused:
        runlock.acquire(tmp_path / "other", say=said.append)
    assert f"delete {path}" in str(refused.value) and refused.value.exit_code == EXIT_USER_ERROR
    assert json.loads(path.read_text())["host"] == "node-b"  # the record is kept for the user to judge


def test_a_held_lock_refuses_a_second_holder_until_released(tmp_path):
    lock = runlock.acquire(tmp_path)
    with pytest.raises(runlock.OutputDirInUseError, match=f"pid {os.getpid()} on host"):
        runlock.acquire(tmp_path)  # another open file description: flock conflicts even within one process
    lock.release()
    runlock.acquire(tmp_path).release()


def test_a_lock_still_held_for_a_gone_predecessor_of_this_host_is_waited_for_then_exit_200(tmp_path, monkeypatch):
    """A restarted pod (same hostname) whose predecessor's flock a network filesystem has not released
    yet (an NFS lease): waiting, not exit 1; past RELEASE_WAIT_S, exit 200 so the restart tries again."""
    import fcntl

    from llmft.trainer.errors import EXIT_TRANSIENT, TransientError

    path = _write_holder(
        tmp_path, pid=2**22 + 17, host=socket.gethostname(), boot_id="earlier-boot", start=1, since="x"
    )
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the filesystem still holds it for the gone predecessor
    monkeypatch.setattr(runlock, "RELEASE_WAIT_S", 0.0)
    monkeypatch.setattr(runlock, "WAIT_POLL_S", 0.01)
    said: list[str] = []
    try:
        with pytest.raises(TransientError, match="an earlier run of this host") as failure:
            runlock.acquire(tmp_path, say=said.append)
        assert failure.value.exit_code == EXIT_TRANSIENT and said and "waiting" in said[0]
    finally:
        os.close(fd)
    runlock.acquire(tmp_path, say=said.append).release()  # released: the next start takes it over
    assert "took over" in said[-1]
