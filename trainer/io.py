"""Atomic file and directory writes, and content hashing.

Every artifact the project writes goes through these helpers: a reader either
sees the previous complete version or the new complete version, never half of
one. Directories are built under a temporary sibling name, fsynced, renamed into
place, and (where the caller asks) only then given a completion marker.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

COMPLETE_MARKER = "COMPLETE"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _share(path: str | os.PathLike, mode: int) -> None:
    """mkstemp/mkdtemp create 0600/0700; give the final artifact the usual umask-based
    mode so pods running as another user can read it on a shared volume."""
    os.chmod(path, mode & ~_umask())


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


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, *, overwrite: bool = True, marker: bool = False) -> Iterator[Path]:
    """Yield a temp dir next to ``final``; on success rename it to ``final``.

    On an exception the temp dir is removed and ``final`` is untouched. With
    ``marker=True`` a ``COMPLETE`` file is written after the rename, so readers
    that check :func:`is_complete` never load a directory mid-write.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    _share(tmp, 0o777)
    try:
        yield tmp
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                with open(os.path.join(root, name), "rb") as fh:
                    os.fsync(fh.fileno())
        if final.exists():
            if not overwrite:
                raise FileExistsError(f"{final} already exists")
            trash = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
        if marker:
            atomic_write_text(final / COMPLETE_MARKER, "ok\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_complete(directory: str | os.PathLike) -> bool:
    """True when ``directory`` carries its completion marker."""
    return (Path(directory) / COMPLETE_MARKER).is_file()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(paths: list[str | os.PathLike]) -> str:
    """Hash of several files (names relative to their own dir + contents), order-independent."""
    h = hashlib.sha256()
    for p in sorted(Path(x) for x in paths):
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()
