"""Reading files from a directory someone handed us, without following what a link points to.

Export (and the serving-form merge built on it), promote and ``llmft data prepare`` copy or quote
files from directories a user or an earlier step wrote. A symlink there may point anywhere
(``/etc/passwd``, a mounted Secret, a service-account token) and would land in a servable artifact
or in ``rejects.jsonl``; a FIFO or device would hang the read or never end. Every such read goes
through this module and is refused (:class:`UnsafeInputError`, exit 1, one line naming the file
and the fix) unless the path

* is a regular file itself (``lstat``: no symlink, FIFO, device, socket or directory), and
* resolves inside the directory it was found in (no parent folder that is a link out of it).

The open uses ``O_NOFOLLOW | O_NONBLOCK`` and checks ``fstat`` again, so a file swapped for a link
or a FIFO between the check and the read is refused too.

One exception: a Hugging Face hub cache snapshot (``models--ORG--NAME/snapshots/REV/``) is made of
symlinks into the same repo folder's ``blobs/``. There (and only there) a link that resolves to a
regular file inside that repo folder is followed: that is huggingface_hub's own layout
(``huggingface_hub/file_download.py``, ``_create_symlink``); any other link is refused.

Refuse, never skip: a skipped tokenizer file or dataset shard would give an artifact that looks
complete but is not what the user asked for. Torch-free: the promote step runs on the pipeline image.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

from llmft.trainer.errors import ConfigError

HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


class UnsafeInputError(ConfigError):
    """A file to be copied or read into an artifact is a symlink, FIFO, device or lies outside its directory."""


def describe_mode(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def hub_repo_root(directory: str | os.PathLike[str]) -> Path | None:
    """``models--ORG--NAME`` when ``directory`` is (inside) a hub cache snapshot of it, else None."""
    directory = Path(os.path.abspath(directory))
    for folder in (directory, *directory.parents):
        if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith(HUB_REPO_PREFIXES):
            return folder.parent.parent
    return None


def _refuse(path: Path, what: str, fix: str) -> UnsafeInputError:
    return UnsafeInputError(f"{path} is {what}; refusing to read it into an artifact. {fix}")


def check_file(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> Path:
    """The path to open for ``path`` (found in ``directory``) when it is a regular file inside
    ``directory``; :class:`UnsafeInputError` otherwise. A missing file raises FileNotFoundError."""
    path, directory = Path(path), Path(directory)
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        target = Path(os.readlink(path))
        repo = hub_repo_root(directory)
        resolved = path.resolve()
        if repo is not None and resolved.is_relative_to(repo.resolve()) and resolved.is_file():
            return resolved  # huggingface_hub's snapshot -> blobs link
        raise _refuse(path, f"a symlink (to {target})", "Replace the link with a copy of the file it points to")
    if not stat.S_ISREG(mode):
        raise _refuse(path, describe_mode(mode), "Only regular files are read")
    real_dir, real = directory.resolve(), path.resolve()
    if not real.is_relative_to(real_dir):
        raise _refuse(path, f"resolves to {real}, outside {directory}", "Keep the files inside that folder")
    return path


def open_file(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for binary reading after :func:`check_file`; the open itself follows no link
    and does not block on a FIFO, and what it opened must still be a regular file."""
    checked = check_file(path, directory)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    if checked == Path(path):
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(checked, flags)
    except OSError as exc:
        if exc.errno == getattr(os, "ELOOP", None) or "ELOOP" in str(exc):
            raise _refuse(Path(path), "a symlink", "Replace the link with a copy of the file") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse(Path(path), describe_mode(mode), "Only regular files are read")
    if flags & getattr(os, "O_NONBLOCK", 0):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike[str], directory: str | os.PathLike[str]) -> bytes:
    with open_file(path, directory) as fh:
        return fh.read()


def read_text(path: str | os.PathLike[str], directory: str | os.PathLike[str], encoding: str = "utf-8") -> str:
    return read_bytes(path, directory).decode(encoding)


def copy_file(
    source: str | os.PathLike[str], target: str | os.PathLike[str], directory: str | os.PathLike[str]
) -> None:
    """Copy the regular file ``source`` (found in ``directory``) to ``target`` (a new file; the caller's
    atomic directory gives it the umask mode)."""
    with open_file(source, directory) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


def present(path: str | os.PathLike[str]) -> bool:
    """Whether anything (a link included, dangling or not) is at ``path``: the test to use before
    :func:`copy_file`, so a link or FIFO is refused rather than silently skipped like ``is_file()`` does."""
    return os.path.lexists(path)
