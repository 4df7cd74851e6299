"""One writer of an output folder at a time (llmft/trainer/output_lock.py): two `llmft data tokenize --output T`
at once, two exports into one folder, two pipeline runs sharing tokenized/<cache key> (issue 45's probe)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from llmft.trainer.io import atomic_directory, is_complete, owner_kind
from llmft.trainer.output_lock import lock_path, output_lock


def _write(final, text: str, entered: threading.Event | None = None, release: threading.Event | None = None):
    with atomic_directory(final, kind="test-output", marker=True) as tmp:
        (tmp / "payload.txt").write_text(text)
        if entered is not None:
            entered.set()
            assert release is not None and release.wait(30)


def test_a_second_writer_waits_for_the_first_and_both_succeed(tmp_path, capsys):
    """Two writers of one folder (two threads here): the second waits until the first committed, then replaces it;
    neither fails and the folder is always whole."""
    final = tmp_path / "out"
    entered, release = threading.Event(), threading.Event()
    first = threading.Thread(target=_write, args=(final, "first", entered, release))
    first.start()
    assert entered.wait(30)
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (_write(final, "second"), second_done.set()))
    second.start()
    time.sleep(0.5)
    assert not second_done.is_set() and not final.exists()  # it waits; nothing half-swapped
    release.set()
    first.join(30)
    second.join(30)
    assert second_done.is_set() and is_complete(final) and owner_kind(final) == "test-output"
    assert (final / "payload.txt").read_text() == "second"
    assert "another llmft process is writing it; waiting for it to finish" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder, no lock file left


def test_the_lock_is_reentrant_within_a_thread_and_held_across_processes(tmp_path):
    final = tmp_path / "out"
    with output_lock(final), output_lock(final):  # tokenize holds it around its cache check and its write
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
                "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(9)",
                str(lock_path(final)),
            ],
            timeout=60,
        )
        assert probe.returncode == 9  # another process cannot take it
        held = lock_path(final).stat()
        assert held.st_size == 0 and held.st_mode & 0o777 == 0o666 & ~_umask()  # never written; the umask's mode
    assert not lock_path(final).exists()  # removed by its holder


@pytest.mark.slow
def test_two_tokenizes_of_one_folder_at_once_both_succeed(tmp_path, tiny_model_dir):
    """Was: one exited 200 ("I/O fault": the other moved the folder while it wrote its COMPLETE marker)."""
    from llmft.demo import sample_path
    from llmft.trainer.data.prepare import prepare_dataset

    prepare_dataset(str(sample_path("alpaca_demo")), tmp_path / "prepared")
    command = [sys.executable, "-m", "llmft", "data", "tokenize", "--input", str(tmp_path / "prepared")]
    command += ["--model", str(tiny_model_dir), "--output", str(tmp_path / "tok"), "--num-proc", "1"]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert is_complete(tmp_path / "tok")
    assert sum("cache hit" in out for out, _ in outputs) <= 1


def test_a_filesystem_without_flock_writes_without_a_lock_and_other_errors_are_raised(tmp_path, monkeypatch):
    import errno
    import fcntl

    from llmft.trainer import output_lock as module

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(module.fcntl, "flock", no_locks)
    with output_lock(tmp_path / "out"):  # some FUSE or object stores: as before the lock existed
        pass

    def broken(fd, operation):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(module.fcntl, "flock", broken)
    with pytest.raises(OSError, match="Input/output error"), output_lock(tmp_path / "out"):
        pass
    monkeypatch.setattr(module.fcntl, "flock", fcntl.flock)
    assert lock_path(tmp_path / "a" / ".." / "out") == tmp_path / ".out.llmft-writer.lock"
    assert lock_path("out").parent == __import__("pathlib").Path.cwd()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_symlink_where_the_lock_goes_is_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    lock_path(tmp_path / "out").symlink_to(elsewhere)
    with pytest.raises(OSError), output_lock(tmp_path / "out"):
        pass
    assert not elsewhere.exists()  # nothing created through the link
