"""Atomic file and directory writes, and content hashing.

Every artifact the project writes goes through these helpers: a reader either
sees the previous complete version or the new complete version, never half of
one. Directories are built under a temporary sibling name, fsynced, renamed into
place, and (where the caller asks) only then given a completion marker.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmft.trainer.errors import OutputNotOursError
from llmft.trainer.output_lock import output_lock
from llmft.trainer.storage import disk_guard

COMPLETE_MARKER = "COMPLETE"
TRAINING_MANIFEST = "training_manifest.json"
"""Written by the trainer into ``final/`` when a run finished (names its run_id); the train step copies it
into its KFP artifact, promote and register read it."""
OWNER_FILE = ".llmft-owner.json"
"""Written into every directory this program creates as a whole (prepared data, tokenized
shards, run directories, promoted adapters, the tiny model): ``{"kind": ..., "created": ...}``.
Only a directory carrying it (of the same kind) is ever replaced or pruned."""
STALE_TEMP_SECONDS = 24 * 3600
"""A temporary sibling (``.NAME.*.tmp``) written by another host is removed after this long; one
written on this host is removed as soon as the process that wrote it is gone."""

log = logging.getLogger(__name__)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _share(path: str | os.PathLike, mode: int) -> None:
    """mkstemp/mkdtemp create 0600/0700; give the final artifact the usual umask-based
    mode so pods running as another user can read it on a shared volume."""
    os.chmod(path, mode & ~_umask())


def share_files(directory: str | os.PathLike[str]) -> None:
    """Give every file under ``directory`` the umask-based mode (0644 under the usual umask 022).

    safetensors creates its files 0600 whatever the umask, and ``shutil.copy2`` keeps that mode,
    so a serving pod running under another UID could not read a promoted adapter. Call this on
    every directory of weights before it is committed."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            _share(os.path.join(root, name), 0o666)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same dir + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        _share(tmp, 0o666)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def owner_kind(directory: str | os.PathLike) -> str | None:
    """The ``kind`` this program recorded in ``directory`` (None: not written by us)."""
    try:
        return json.loads((Path(directory) / OWNER_FILE).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def write_owner(directory: str | os.PathLike, kind: str) -> None:
    """Mark ``directory`` as written by this program as ``kind``."""
    atomic_write_json(
        Path(directory) / OWNER_FILE, {"kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    )


def check_output_target(
    path: str | os.PathLike, *, kind: str, force: bool = False, inputs: tuple[str | os.PathLike, ...] = ()
) -> None:
    """Refuse to replace what this program did not write.

    ``path`` may be absent, an empty directory, or a directory carrying our owner marker of
    ``kind``; anything else (a file, somebody's folder, ours of another kind) raises
    :class:`~llmft.trainer.errors.OutputNotOursError` unless ``force``. An output that is one of
    ``inputs`` or contains one, or that is the current directory or contains it, is refused even
    with ``force``: the input (or the folder the user stands in) would be deleted.
    """

    target = Path(path).resolve()
    for item in inputs:
        source = Path(item).resolve()
        if source == target or target in source.parents:
            raise OutputNotOursError(f"{path}: the output would replace the input {item}; choose another output path")
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current directory was deleted: nothing to protect
        cwd = None
    if cwd is not None and (target == cwd or target in cwd.parents):
        raise OutputNotOursError(
            f"{path} is the current directory (or holds it); replacing it would delete it. "
            "Choose a new folder for the output, e.g. ./out"
        )
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and (not any(target.iterdir()) or owner_kind(target) == kind):
        return
    if force:
        return
    what = "a file" if not target.is_dir() else f"a non-empty directory not written by llmft as {kind}"
    raise OutputNotOursError(
        f"{path} is {what}; refusing to replace it. Choose a new output path, or pass --force to replace it"
    )


OWNED_FILE_MARK = "# written by llmft"
"""First line of every single file this program writes for a user to read (a compiled pipeline, a
rendered job): only a file that starts with it is replaced without ``--force``."""


def write_owned_file(path: str | os.PathLike, text: str, *, command: str, force: bool = False) -> Path:
    """Write ``text`` (after a first line ``# written by llmft <command>``) to ``path`` atomically.

    The single-file form of :func:`check_output_target`: an absent path, or a file whose first line is
    :data:`OWNED_FILE_MARK`, is replaced; a file this program did not write, or a symlink (never written
    through: its target would change), is refused (:class:`~llmft.trainer.errors.OutputNotOursError`)
    unless ``force``, which replaces the file or the link itself, never what a link points to. A
    directory is refused even with ``force``."""
    check_owned_file(path, force=force)
    return atomic_write_text(path, f"{OWNED_FILE_MARK} {command}\n{text}")


def check_owned_file(path: str | os.PathLike, *, force: bool = False) -> None:
    """What :func:`write_owned_file` refuses, checked before any work (the command fails in one line first)."""

    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise OutputNotOursError(f"{path} is a directory; choose a file name for the output, e.g. {path}/out.yaml")
    if path.is_symlink() and not force:
        raise OutputNotOursError(
            f"{path} is a symlink (to {os.readlink(path)}); refusing to write through it. Choose a new output path, "
            "or pass --force to replace the link itself (its target is never written)"
        )
    if path.exists() and not path.is_symlink() and not force and not _owned_file(path):
        raise OutputNotOursError(
            f"{path} is a file llmft did not write; refusing to replace it. Choose a new output path, "
            "or pass --force to replace it"
        )


def _owned_file(path: Path) -> bool:
    if not path.is_file():  # a FIFO or device is nobody's output (and opening a FIFO would block)
        return False
    try:
        with open(path, "rb") as fh:
            return fh.readline(200).startswith(OWNED_FILE_MARK.encode())
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _writer_record(kind: str) -> dict:
    return {"kind": kind, "partial": True, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


def _is_stale(path: Path, record: dict, now: float) -> bool:
    """Whether a temp dir is abandoned: its writer (same host) is gone, or it is older than the bound."""
    pid, host = record.get("pid"), record.get("host")
    if isinstance(pid, int) and host == socket.gethostname():
        return pid != os.getpid() and not _pid_alive(pid)
    started = record.get("started")
    if not isinstance(started, int | float):
        try:
            started = path.stat().st_mtime
        except OSError:
            return False
    return now - started > STALE_TEMP_SECONDS


def remove_stale_temps(final: str | os.PathLike, *, kind: str) -> list[Path]:
    """Remove the abandoned ``.NAME.*.tmp`` siblings of ``final`` (a killed run's half-written
    output): only those carrying our owner record of ``kind`` and only when stale (see
    :data:`STALE_TEMP_SECONDS`). Returns what was removed."""
    final = Path(final)
    removed: list[Path] = []
    now = time.time()
    try:
        candidates = sorted(final.parent.glob(f".{glob.escape(final.name)}.*.tmp"))
    except OSError:
        return removed
    for path in candidates:
        try:
            record = json.loads((path / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours (or not a directory): never touched
        if not isinstance(record, dict) or record.get("kind") != kind or not _is_stale(path, record, now):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            log.warning(
                "removed %s: a temporary %s left by process %s on %s", path, kind, record.get("pid"), record.get("host")
            )
    return removed


@contextlib.contextmanager
def atomic_directory(
    final: str | os.PathLike,
    *,
    kind: str,
    overwrite: bool = True,
    marker: bool = False,
    force: bool = False,
    inputs: tuple[str | os.PathLike, ...] = (),
) -> Iterator[Path]:
    """Yield a temp dir next to ``final``; on success rename it to ``final``.

    ``final`` is checked first (:func:`check_output_target`: only an absent or empty path, or a
    directory we wrote as ``kind``, is replaced unless ``force``) and the new directory gets our
    owner marker. Abandoned temp dirs of earlier, killed runs are removed first
    (:func:`remove_stale_temps`). Every file gets the umask-based mode (:func:`share_files`). On an
    exception the temp dir is removed and ``final`` is untouched. With ``marker=True`` a
    ``COMPLETE`` file is written after the rename, so readers that check :func:`is_complete`
    never load a directory mid-write. One writer of ``final`` at a time: a second waits
    (:func:`~llmft.trainer.output_lock.output_lock`).
    """
    final = Path(os.path.abspath(final))  # "." or "x/.." have no name to build a sibling from
    with output_lock(final):  # one writer at a time, from the check to the marker (llmft/trainer/output_lock.py)
        with _atomic_directory(final, kind, overwrite, marker, force, inputs) as tmp:
            yield tmp


@contextlib.contextmanager
def _atomic_directory(final: Path, kind: str, overwrite: bool, marker: bool, force: bool, inputs) -> Iterator[Path]:
    if overwrite:
        check_output_target(final, kind=kind, force=force, inputs=inputs)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final, kind=kind)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    _share(tmp, 0o777)
    with disk_guard(final, what=kind, cleanup=[tmp]):  # any failure removes tmp; a full disk is one line
        atomic_write_json(tmp / OWNER_FILE, _writer_record(kind))  # lets a later run tell ours, and stale
        yield tmp
        write_owner(tmp, kind)
        share_files(tmp)
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                with open(os.path.join(root, name), "rb") as fh:
                    os.fsync(fh.fileno())
        if final.exists() or final.is_symlink():
            if not overwrite:
                raise FileExistsError(f"{final} already exists")
            _replace(final, tmp, kind)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
        if marker:
            atomic_write_text(final / COMPLETE_MARKER, "ok\n")


def _replace(final: Path, tmp: Path, kind: str) -> None:
    """Swap ``tmp`` in for the existing ``final``; the old one goes to a ``.NAME.old-*.tmp`` sibling
    (marked as ours, so a later run removes it if this one dies before it does)."""
    trash = final.with_name(f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    os.replace(final, trash)
    if trash.is_dir() and not trash.is_symlink():
        with contextlib.suppress(OSError):
            atomic_write_json(trash / OWNER_FILE, _writer_record(kind))
    os.replace(tmp, final)
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            trash.unlink()


def is_complete(directory: str | os.PathLike) -> bool:
    """True when ``directory`` carries its completion marker."""
    return (Path(directory) / COMPLETE_MARKER).is_file()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
