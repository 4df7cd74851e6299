"""What ``llmft pipeline run-local`` does about other processes: one run per work folder, and a stop signal
passed on to the running task.

* :func:`work_folder_lock`: an exclusive ``flock`` on ``<work>/.run-local.lock`` for the whole run. Two runs
  on one work folder would share its MLflow SQLite store (two fresh stores migrating at once fail with
  "table _alembic_tmp_experiments already exists"), its volume folder and its log: the second one stops at
  once with one line naming the first (pid, since when) and the fix (wait, or another ``--work-dir``). The
  kernel drops the lock when the holder exits, however it exits.
* :class:`StopForwarder`: SIGTERM to run-local (``kill``, a CI job's timeout, a container stop) is passed to
  the running task's process (the KFP executor under kfp.local's ``sh -c``), which stops as it would in its
  pod (the train task forwards it to ``llmft train``, whose ranks commit a checkpoint and exit 143; the other
  steps remove what they half-wrote). Once that task ended no other task, retry or exit handler starts
  (llmft/pipelines/local_run.py ``ProgressStream``); a task that starts meanwhile gets the signal too.
  run-local then exits 143. A second SIGTERM stops everything at once (SIGKILL to every process below it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llmft.trainer.errors import ConfigError, SignalStop

LOCK_FILE = ".run-local.lock"
WATCH_EVERY_S = 0.2


class WorkFolderInUse(ConfigError):
    """Another run-local holds the work folder (exit 1)."""


@contextlib.contextmanager
def work_folder_lock(work: Path) -> Iterator[None]:
    """Hold the work folder for this process (:class:`WorkFolderInUse` when another run holds it)."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkFolderInUse(
                f"work folder {work} is in use by another `llmft pipeline run-local` ({_holder(fd)}); wait for it to "
                "finish, or pass --work-dir with another folder"
            ) from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield
    finally:
        os.close(fd)  # drops the lock


def _holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        record = {}
    if not record:
        return "a process that has not written its name yet"
    return f"pid {record.get('pid')} on {record.get('host')}, since {record.get('since')}"


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


SHELLS = frozenset({"sh", "bash", "dash"})
"""kfp.local starts each task as ``sh -c '... python3 -m kfp.dsl.executor_main ...'``: the shell is no task."""


def task_processes(pid: int) -> list[int]:
    """The processes that run the tasks below ``pid``: its children, looking through the shells kfp.local starts
    them with (a shell killed by SIGTERM would orphan its task, which never hears the signal)."""
    found = []
    for child in children(pid):
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except OSError:
            continue
        found += task_processes(child) if name in SHELLS else [child]
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


class StopForwarder:
    """While installed (a context manager; main thread only): SIGTERM is forwarded to the direct children (the
    tasks kfp.local runs) and to every child started later, until the block ends; :attr:`signum` records it."""

    def __init__(self, current: Callable[[], str | None] = lambda: None, say: Callable[[str], None] | None = None):
        self.current, self.say = current, say or (lambda text: print(text, file=sys.__stderr__, flush=True))
        self.signum = 0
        self.task: str | None = None
        """The task that was running when the signal came (None: between tasks)."""
        self._signalled: set[int] = set()
        self._done = threading.Event()
        self._previous: Any = None

    def __enter__(self) -> StopForwarder:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, _frame) -> None:
        if self.signum:  # a second one: stop now
            for pid in descendants(os.getpid()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise SignalStop(signum, "stopped by a second SIGTERM: every task was killed at once")
        self.signum, self.task = signum, self.current()
        running = f"task {self.task}" if self.task else "the pipeline"
        self.say(f"run-local: {signal.Signals(signum).name} received; stopping {running} ...")
        self._forward()
        threading.Thread(target=self._watch, name="run-local-stop", daemon=True).start()

    def _forward(self) -> None:
        for pid in task_processes(os.getpid()):
            if pid not in self._signalled:
                self._signalled.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, self.signum)

    def _watch(self) -> None:
        while not self._done.wait(WATCH_EVERY_S):
            self._forward()  # a task kfp.local starts after the stop (its exit handler) stops too
