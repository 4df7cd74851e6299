"""Issue 27 item 1, data side: `llmft data prepare` follows no symlink and reads no FIFO or device
(llmft/trainer/safe_files.py). Before the fix a dataset folder holding `leak.jsonl -> /etc/passwd` was read,
and every line of the linked file was quoted in rejects.jsonl."""

from __future__ import annotations

import os

import pytest
from data_helpers import chat, write_jsonl
from test_data_failures import assert_one_line_error, in_process

SECRET = "".join(f"user{i}:x:{i}:{i}:CANARY:/home/u{i}:/bin/sh\n" for i in range(24))


def leaks(directory) -> list[str]:
    return [str(p) for p in directory.rglob("*") if p.is_file() and "CANARY" in p.read_text(errors="replace")]


@pytest.mark.parametrize("where", ["in-folder", "as-input"])
def test_prepare_refuses_a_symlinked_data_file(tmp_path, capsys, where):
    secret = tmp_path / "passwd"
    secret.write_text(SECRET)
    data = tmp_path / "data"
    write_jsonl(data / "good.jsonl", [chat(f"Q{i}?", f"A{i}.") for i in range(20)])
    (data / "leak.jsonl").symlink_to(secret)
    source = data if where == "in-folder" else data / "leak.jsonl"
    run = in_process(capsys, "data", "prepare", "--input", str(source), "--output", str(tmp_path / "out"))
    assert_one_line_error(run, 1, "leak.jsonl is a symlink", "refusing")
    assert "CANARY" not in run.stderr + run.stdout
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_prepare_refuses_a_fifo_instead_of_hanging(tmp_path, capsys):
    data = tmp_path / "data"
    write_jsonl(data / "good.jsonl", [chat(f"Q{i}?", f"A{i}.") for i in range(20)])
    os.mkfifo(data / "pipe.jsonl")
    run = in_process(capsys, "data", "prepare", "--input", str(data), "--output", str(tmp_path / "out"))
    assert_one_line_error(run, 1, "pipe.jsonl is a FIFO")


def test_prepare_does_not_enter_a_linked_folder(tmp_path, capsys, caplog):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "rows.jsonl").write_text(SECRET)
    data = tmp_path / "data"
    write_jsonl(data / "good.jsonl", [chat(f"Q{i}?", f"A{i}.") for i in range(20)])
    (data / "more").symlink_to(outside)
    run = in_process(capsys, "data", "prepare", "--input", str(data), "--output", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    assert not leaks(tmp_path / "out") and "not followed" in caplog.text
