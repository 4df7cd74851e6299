"""One writer of an output folder at a time (issue 45's probe: two `llmft data tokenize --output T` at once, two
exports into one folder, two pipeline runs on the same data sharing ``tokenized/<cache key>``).

Every :func:`~llmft.trainer.io.atomic_directory` write holds :func:`output_lock` from its check of the target to
its completion marker (and the FP8 base's dequantized copy, which the ranks of a node share, around its build):
an exclusive ``fcntl.flock`` on ``.NAME.llmft-writer.lock`` beside the output (the kernel, or a
network filesystem's lock manager, releases it when the holder exits, however it exits). A second writer waits
for the first, saying so in one line, then runs: both succeed, and the second replaces the first's output
with its own (``llmft data tokenize`` finds the first's folder a cache hit and rewrites nothing). Before, the
second's swap moved the folder away while the first wrote its ``COMPLETE`` marker into it: exit 200, a
missing ``.COMPLETE.*.tmp``, or "Directory not empty". The lock file is empty, never written, and removed by its
holder before it lets go (a waiter then finds it gone and takes a fresh one); a filesystem without flock (some
FUSE or object stores) writes without it, as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_HELD: dict[tuple[Path, int], int] = {}  # (lock file, thread) -> nested holders (flock is per open file, not thread)


def lock_path(final: str | os.PathLike) -> Path:
    final = Path(os.path.abspath(final))
    return final.parent / f".{final.name}.llmft-writer.lock"


@contextlib.contextmanager
def output_lock(final: str | os.PathLike) -> Iterator[None]:
    """Hold the one-writer lock of the output ``final`` (re-entrant within a thread; another thread waits)."""
    path = lock_path(final)
    key = (path, threading.get_ident())
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _locked_file(path, final)
    _HELD[key] = 1
    try:
        yield
    finally:
        del _HELD[key]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still held: nothing is left beside the output
        os.close(fd)  # releases the lock


def _locked_file(path: Path, final: str | os.PathLike) -> int:
    """An open descriptor of ``path`` holding its lock. The holder removes the file before it lets go, so a lock
    taken on a file that is no longer at ``path`` (a waiter's, on the removed one) is dropped and taken again.
    A symlink at ``path`` is never followed (O_NOFOLLOW: the open fails)."""
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            _acquire(fd, final)
            held, now = os.fstat(fd), os.lstat(path)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _acquire(fd: int, final: str | os.PathLike) -> None:
    """Lock ``fd``; when another process holds it, say so (stderr is line-buffered) and wait."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    except OSError as exc:
        if exc.errno in NO_FLOCK:
            return  # no locks on this filesystem: write without one
        raise
    print(
        f"[llmft] {os.path.abspath(final)}: another llmft process is writing it; waiting for it to finish",
        file=sys.stderr,
    )
    fcntl.flock(fd, fcntl.LOCK_EX)
