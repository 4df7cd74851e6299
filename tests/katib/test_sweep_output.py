"""`llmft sweep create --output` follows the owned-file rule of compile and render-job (issue 35 item 1):
a file llmft did not write, or a symlink, is refused in one line before any work, and never written through."""

from __future__ import annotations

import os

from llmft.cli import main as llmft_main

ARGS = ["sweep", "create", "--dry-run", "data=/data/tokenized/x"]


def test_refuses_a_users_file_and_keeps_it(tmp_path, capsys):
    notes = tmp_path / "notes.yaml"
    notes.write_text("my notes\n")
    assert llmft_main([*ARGS, "--output", str(notes)]) == 1
    err = capsys.readouterr().err
    assert notes.read_text() == "my notes\n"
    assert err.startswith("error: ") and "llmft did not write" in err and "--force" in err and err.count("\n") == 1


def test_never_writes_through_a_symlink(tmp_path, capsys):
    target = tmp_path / "target.yaml"
    target.write_text("kept\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    assert llmft_main([*ARGS, "--output", str(link)]) == 1
    assert "symlink" in capsys.readouterr().err
    assert target.read_text() == "kept\n" and link.is_symlink()
    assert llmft_main([*ARGS, "--output", str(link), "--force"]) == 0  # replaces the link itself
    assert target.read_text() == "kept\n" and not link.is_symlink()
    assert "kind: Experiment" in link.read_text()


def test_rewrites_its_own_output_and_force_replaces(tmp_path):
    out = tmp_path / "exp.yaml"
    assert llmft_main([*ARGS, "--output", str(out)]) == 0
    first = out.read_text()
    assert first.startswith("# written by llmft sweep create\n") and "kind: Experiment" in first
    assert llmft_main([*ARGS, "max_trials=4", "--output", str(out)]) == 0  # ours: replaced without --force
    assert "maxTrialCount: 4" in out.read_text()
    mine = tmp_path / "mine.yaml"
    mine.write_text("x: 1\n")
    assert llmft_main([*ARGS, "--output", str(mine), "--force"]) == 0
    assert "kind: Experiment" in mine.read_text()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_output_needs_a_yaml_name(tmp_path, capsys):
    assert llmft_main([*ARGS, "--output", str(tmp_path / "exp.txt")]) == 1
    assert "give it a .yaml name" in capsys.readouterr().err
