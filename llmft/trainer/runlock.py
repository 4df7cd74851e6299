"""One run per ``output_dir``: an exclusive lock on the run directory (issue 27.4).

Two runs writing into one ``output_dir`` at once both "succeed" while one's ``final/`` replaces
the other's and ``metrics.jsonl`` holds both. Rank 0 (the global rank 0: on a shared volume every
node sees the same directory, and the ranks of one run are one run) takes the lock before it plans
the run, and keeps it until the process ends:

- **The lock** is ``fcntl.flock(LOCK_EX)`` on ``output_dir/.llmft-run.lock``: the kernel (or the
  network filesystem's lock manager) releases it when the holder exits, however it exits; a
  SIGKILL or OOM kill included.
- **The holder record** in the same file (pid, host, boot id, process start time, since when)
  names the holder in the second run's error, and is cleared at a clean exit (signals included).
- **A second run** fails at once with exit 1 (:class:`OutputDirInUseError`, a configuration error:
  two runs may not share a directory, and a retry would not cure it), naming the holder; with
  ``wait_for_output_dir=true`` (``llmft train --wait``) it waits for the holder to end instead.
- **A leftover record** (the holder died without clearing it) is stale when it names this host
  and its process is gone (same pid and start time, same boot): the new run takes over with a
  warning. A record of another host cannot be checked from here (a filesystem whose locks do not
  span hosts would let both runs in): the run refuses and says how to clear it. A pod restarted by
  the Training Operator or JobSet keeps its hostname (the pod name), so its restart takes over.
- **A lock the filesystem has not let go of yet**: the flock is held, but the record names this
  host and no such process runs here: a restarted pod whose previous incarnation's lock a network
  filesystem keeps until its lease expires (NFSv4: about 90 s after a lost client). The run waits
  up to ``RELEASE_WAIT_S`` for it, then exits 200 (transient: the restart tries again).
- **No flock** (some FUSE or object-store filesystems): a warning, and the holder record alone
  guards the directory (a live holder on this host still refuses a second run).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from llmft.trainer.errors import ConfigError, TransientError

LOCK_FILE = ".llmft-run.lock"
WAIT_POLL_S = 1.0
RELEASE_WAIT_S = 300.0  # how long a restarted run waits for the filesystem to release its predecessor's lock
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class OutputDirInUseError(ConfigError):
    """Another run holds ``output_dir`` (exit 1: never retried)."""


class RunLock:
    """A held lock: :meth:`release` clears the holder record and drops the lock (idempotent)."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass  # a full or lost disk: the lock still goes with the descriptor
        os.close(self.fd)
        self.fd = -1


def acquire(output_dir: str | os.PathLike, *, wait: bool = False, say=print) -> RunLock:
    """Lock ``output_dir`` (created if missing) for this process; raise :class:`OutputDirInUseError`
    when another run holds it (or, with ``wait``, wait for it to end). ``say`` prints the warnings."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        _wait_for_lock(fd, path, wait, say)
        _check_leftover(fd, path, say)
        _write_record(fd)
    except BaseException:
        os.close(fd)
        raise
    return RunLock(path, fd)


def _wait_for_lock(fd: int, path: Path, wait: bool, say) -> None:
    announced, deadline = False, time.monotonic() + RELEASE_WAIT_S
    while True:
        locked = _try_flock(fd, path, say)
        holder = read_record(fd) or None  # an empty record is no holder
        live_here = holder is not None and _same_machine(holder) and _alive(holder)
        if locked or (locked is None and not live_here):
            return
        predecessor = locked is False and holder is not None and _same_host(holder) and not live_here
        if not (wait or predecessor):
            raise OutputDirInUseError(
                f"output_dir={path.parent} is in use by another run: {describe(holder)} (lock {path}). Wait for it "
                "to finish (llmft train --wait, or wait_for_output_dir=true), stop it, or choose another output_dir"
            )
        if not announced:
            say(f"[llmft] output_dir={path.parent} is in use by {describe(holder)}; waiting for it to end")
            announced = True
        if predecessor and time.monotonic() > deadline:
            raise TransientError(
                f"output_dir={path.parent}: the filesystem still holds the lock of {describe(holder)}, an earlier "
                f"run of this host that no longer runs, after {RELEASE_WAIT_S:g} s; exit 200 so the run is retried"
            )
        time.sleep(WAIT_POLL_S)


def _try_flock(fd: int, path: Path, say) -> bool | None:
    """True: locked; False: another process holds it; None: the filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in NO_FLOCK:
            raise
        say(
            f"[llmft] warning: {path}: the filesystem does not support flock ({exc.strerror}); only the holder "
            "record guards output_dir against a second run"
        )
        return None


def _check_leftover(fd: int, path: Path, say) -> None:
    """A record left by a holder that died without clearing it: take over or refuse (module docstring)."""
    holder = read_record(fd)
    if not holder or _is_me(holder):
        return
    if not _same_host(holder):
        raise OutputDirInUseError(
            f"output_dir={path.parent} is locked by {describe(holder)}, which cannot be checked from host "
            f"{socket.gethostname()}. If that run is gone (its pod deleted, its node lost), delete {path} and "
            "re-run; if it still runs, wait for it or choose another output_dir"
        )
    if _same_machine(holder) and _alive(holder):  # only where flock does not span this filesystem's clients
        raise OutputDirInUseError(f"output_dir={path.parent} is in use by another run: {describe(holder)}")
    say(
        f"[llmft] warning: took over the lock of output_dir={path.parent} from {describe(holder)}, which is not "
        "running (it ended without releasing it: killed, or its pod restarted)"
    )


def describe(holder: dict | None) -> str:
    if not holder:
        return "a process that has not written its name yet"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"


def read_record(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 4096)
        record = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_record(fd: int) -> None:
    record = _identity(os.getpid())
    record["since"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _identity(pid: int) -> dict:
    return {"pid": pid, "host": socket.gethostname(), "boot_id": _boot_id(), "start": _start_ticks(pid)}


def _is_me(holder: dict) -> bool:
    return _same_machine(holder) and holder.get("pid") == os.getpid() and _alive(holder)


def _same_host(holder: dict) -> bool:
    return holder.get("host") == socket.gethostname()


def _same_machine(holder: dict) -> bool:
    return _same_host(holder) and holder.get("boot_id") == _boot_id()


def _alive(holder: dict) -> bool:
    """The recorded process still runs: same pid and same start time (a reused pid is another process)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    start = _start_ticks(pid)
    return start is not None and start == holder.get("start")


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if fields[0] != "Z" else None
