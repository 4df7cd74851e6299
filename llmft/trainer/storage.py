"""A full, over-quota or read-only disk is an environment fault, not a bug.

Writers raise it in many shapes: ``OSError`` (errno ENOSPC, EDQUOT, EROFS, EFBIG), safetensors'
``SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)``, and
torch.save's ``RuntimeError: [enforce fail at inline_container.cc:...] ... unexpected pos`` (its
stream writer drops the errno). :func:`disk_fault` recognises them; :func:`disk_guard` wraps one
artifact's write: on such a fault it removes what was half written (``cleanup``) and raises
:class:`DiskFullError` (exit 200, :data:`~llmft.trainer.errors.EXIT_TRANSIENT`: retried, and a
retried run resumes from its newest complete checkpoint) with one line naming the path, the bytes
needed and the bytes free. Torch-free: the pipeline image imports it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from llmft.trainer.errors import EXIT_TRANSIENT, EXIT_USER_ERROR, TransientError

DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
_TEXTS = {os.strerror(code): code for code in DISK_ERRNOS} | {f"os error {code}": code for code in DISK_ERRNOS}
TORCH_WRITE_FAILURES = ("PytorchStreamWriter failed writing file", "unexpected pos", "file write failed")
"""What torch.save's zip writer (caffe2/serialize/inline_container.cc) says when a write fails: no errno."""
SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")
"""What numpy's ndarray.tofile raises on a short write (an OSError with no errno): the disk took fewer bytes."""
_FIX = {
    errno.EFBIG: "a file-size limit stopped the write (the process's `ulimit -f`, or the file system's largest "
    "file): raise the limit (ulimit -f unlimited; the container's RLIMIT_FSIZE) or write to another file system",
    errno.EROFS: "the volume is mounted read-only: mount it read-write (check the PVC's accessModes and the pod's "
    "volumeMounts)",
    errno.EDQUOT: "free space or raise the quota",
}


_FIX_FULL = "free space on the volume or make it larger (a PVC: resize it; keep_last bounds the checkpoints)"


class DiskFullError(TransientError):
    """A write failed on a full, over-quota or read-only disk (exit 200: retried)."""


def describe_disk_fault(exc: BaseException, what: str) -> str | None:
    """The one-line message for ``exc`` when it is a disk fault (else None): what the command lines print."""
    code = disk_fault(exc)
    if code is None:
        return None
    if isinstance(exc, DiskFullError):
        return str(exc)
    return disk_fault_message(getattr(exc, "filename", None), code, what=what, needed=None)


def disk_fault(exc: BaseException) -> int | None:
    """The errno (ENOSPC, EDQUOT, EROFS, EFBIG) of a disk fault, else None. torch.save's writer failure,
    which carries no errno, counts as ENOSPC (what it nearly always is)."""
    if isinstance(exc, DiskFullError):
        return getattr(exc, "errno", errno.ENOSPC)
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return exc.errno
    text = str(exc)
    found = [code for needle, code in _TEXTS.items() if needle in text]
    if found:
        return found[0]
    if isinstance(exc, RuntimeError) and any(needle in text for needle in TORCH_WRITE_FAILURES):
        return _short_write_cause()
    if isinstance(exc, OSError) and exc.errno is None and SHORT_WRITE.search(text):
        return _short_write_cause()
    return None


def _short_write_cause() -> int:
    """A write that stopped short and said no errno (torch.save, numpy.tofile): EFBIG when this process has a
    file-size limit (``ulimit -f``: Python ignores SIGXFSZ, so the write just stops), else a full disk."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return errno.ENOSPC if limit == resource.RLIM_INFINITY else errno.EFBIG


def disk_fault_exit_code(code: int) -> int:
    """EFBIG (a file-size limit) is the environment's setting: a retry hits it again (exit 1); a full,
    over-quota or read-only disk is retried (exit 200)."""
    return EXIT_USER_ERROR if code == errno.EFBIG else EXIT_TRANSIENT


def _retry_note(code: int) -> str:
    if code == errno.EFBIG:
        return "exit 1: a retry would hit the same limit"
    return "exit 200 is retried by the pipeline"


def describe_path_error(exc: BaseException) -> str | None:
    """One line for a path the OS refuses as written (ENAMETOOLONG): bad input (exit 1), never retried."""
    if not isinstance(exc, OSError) or exc.errno != errno.ENAMETOOLONG:
        return None
    name = str(exc.filename or "")
    longest = max((len(part.encode()) for part in name.split("/")), default=0)
    return (
        f"{name[:80]}...: file name too long ({len(name)} characters, the longest part {longest} bytes; a name may "
        "have at most 255 bytes, a path 4096). Fix: choose a shorter output path"
    )


def free_bytes(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(free, total) bytes of the file system holding ``path`` (its nearest existing folder)."""
    here = Path(os.path.abspath(path))
    for folder in (here, *here.parents):
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(folder)
            return usage.free, usage.total
    return None


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``path`` (what a failed write got onto the disk)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"  # unreachable


def disk_fault_message(
    path: str | os.PathLike[str] | None,
    code: int,
    *,
    what: str,
    needed: int | None,
    written: int = 0,
    cleaned: bool = False,
) -> str:
    """One line: the path, the fault, the bytes needed (or written before it failed) and free, the fix.
    ``path`` None: the writer did not say (safetensors, torch.save); ``what`` then names the output."""
    if path is None:
        return (
            f"{os.strerror(code)} (errno {code}, {errno.errorcode.get(code, '?')}) writing {what}. Fix: "
            f"{_FIX.get(code, _FIX_FULL)}; {_retry_note(code)}"
        )
    space = free_bytes(path)
    free = f"{space[0]} bytes ({human(space[0])}) free of {human(space[1])}" if space else "free space unknown"
    if needed:
        need = f"needs about {needed} bytes ({human(needed)}); "
    else:
        need = f"{written} bytes ({human(written)}) written before it failed; " if written else ""
    return (
        f"{path}: {os.strerror(code)} (errno {code}, {errno.errorcode.get(code, '?')}) writing {what}: {need}{free}. "
        f"{'Nothing half-written was kept. ' if cleaned else ''}Fix: {_FIX.get(code, _FIX_FULL)}; {_retry_note(code)}"
    )


@contextlib.contextmanager
def disk_guard(
    path: str | os.PathLike[str], *, what: str, needed: int | None = None, cleanup: Iterable[Path] = ()
) -> Iterator[None]:
    """Write ``what`` at ``path``: on any failure the ``cleanup`` folders are removed; a disk fault becomes
    :class:`DiskFullError` (naming ``path``, ``needed`` bytes, or what was written when unknown, and the
    bytes free)."""
    try:
        yield
    except BaseException as exc:
        written = sum(tree_bytes(p) for p in cleanup)
        for folder in cleanup:
            shutil.rmtree(folder, ignore_errors=True)
        code = disk_fault(exc)
        if code is None or isinstance(exc, DiskFullError):
            raise
        message = disk_fault_message(path, code, what=what, needed=needed, written=written, cleaned=True)
        error = DiskFullError(message)
        error.errno = code  # type: ignore[attr-defined]
        error.exit_code = disk_fault_exit_code(code)
        raise error from exc
