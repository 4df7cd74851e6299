"""Each rank's exit code, read by `llmft train --nproc N` (llmft/trainer/rank_exits.py): the launcher tells a
failed rank from one stopped by a signal only through these files."""

from __future__ import annotations

from llmft.trainer.rank_exits import EXIT_DIR_ENV, read_rank_exits, write_rank_exit


def test_each_rank_records_its_code_where_the_launcher_reads_it(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # the folder named, never the current one
    monkeypatch.setenv(EXIT_DIR_ENV, str(tmp_path))
    for rank, code in (("0", 143), ("1", 1), ("", 200)):  # RANK empty: one process, rank 0 (overwrites the first)
        monkeypatch.setenv("RANK", rank)
        write_rank_exit(code)
    assert read_rank_exits(str(tmp_path)) == {0: 200, 1: 1}
    monkeypatch.delenv("RANK")  # no RANK at all: rank 0 too
    write_rank_exit(3)
    assert read_rank_exits(str(tmp_path)) == {0: 3, 1: 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "rank-0", "rank-1"]
    assert not any((tmp_path / "cwd").iterdir())
    assert (tmp_path / "rank-1").read_text() == "1\n"


def test_garbage_in_the_folder_is_skipped_and_no_folder_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rank-2").write_text("not a code\n")
    (tmp_path / "notes").write_text("3\n")
    (tmp_path / "rank-3").mkdir()
    for rank in range(10, 20):
        (tmp_path / f"rank-{rank}").write_text("143\n")
    assert read_rank_exits(str(tmp_path)) == dict.fromkeys(range(10, 20), 143)  # a bad entry is skipped, not the end
    for rank in range(10, 20):
        (tmp_path / f"rank-{rank}").unlink()
    monkeypatch.setenv(EXIT_DIR_ENV, str(tmp_path / "absent"))
    write_rank_exit(1)
    monkeypatch.delenv(EXIT_DIR_ENV)
    write_rank_exit(1)
    monkeypatch.setenv(EXIT_DIR_ENV, "")
    write_rank_exit(1)
    assert not (tmp_path / "absent").exists() and read_rank_exits(str(tmp_path)) == {}


def test_a_ranks_error_line_is_one_write(monkeypatch):
    """Two ranks share a pod's stderr: print() writes the text, then the newline (two writes under PYTHONUNBUFFERED,
    which the Training Operator sets), so another rank's line could land between them; say_line writes once."""
    import sys

    from llmft.trainer.__main__ import say_line

    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    say_line("[rank 1] error: x")
    assert writes == ["[rank 1] error: x\n"]
