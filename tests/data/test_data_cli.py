"""`llmft data prepare|tokenize` through the real CLI: exit codes, stderr messages, summaries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import chat, write_jsonl

from llmft.cli import main
from llmft.demo import sample_path


def _llmft(repo_root: Path) -> list[str]:
    script = Path(sys.executable).parent / "llmft"
    return [str(script)] if script.exists() else [sys.executable, "-m", "llmft"]


@pytest.mark.slow
def test_real_cli_prepare_then_tokenize_then_cache_hit(tmp_path, repo_root, tiny_model_dir):
    llmft = _llmft(repo_root)
    prepared, tokenized = tmp_path / "prepared", tmp_path / "tokenized"
    run = subprocess.run(
        [*llmft, "data", "prepare", "--input", str(sample_path("alpaca_demo")), "--output", str(prepared)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo_root,
    )
    assert run.returncode == 0, run.stderr
    assert "503 read, 500 accepted, 3 rejected" in run.stdout
    assert "invalid_json 1" in run.stdout and "rejects.jsonl" in run.stdout
    tokenize = [
        *llmft,
        "data",
        "tokenize",
        "--input",
        str(prepared),
        "--model",
        str(tiny_model_dir),
        "--output",
        str(tokenized),
        "--max-length",
        "256",
        "--num-proc",
        "2",
    ]
    first = subprocess.run(tokenize, capture_output=True, text=True, timeout=120, cwd=repo_root)
    assert first.returncode == 0, first.stderr
    assert "packing" in first.stdout and "train" in first.stdout and "cache hit" not in first.stdout
    second = subprocess.run(tokenize, capture_output=True, text=True, timeout=120, cwd=repo_root)
    assert second.returncode == 0, second.stderr
    assert "cache hit" in second.stdout


@pytest.mark.slow
def test_real_cli_bad_data_exits_1_with_the_lines_on_stderr(tmp_path, repo_root):
    src = write_jsonl(tmp_path / "bad.jsonl", [chat("Q?", "A.")] * 10 + ['{"broken"', {"messages": []}])
    run = subprocess.run(
        [*_llmft(repo_root), "data", "prepare", "--input", str(src), "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo_root,
    )
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert "2 of 12 rows rejected" in run.stderr
    assert f"{src}:11: invalid_json" in run.stderr and f"{src}:12: empty_conversation" in run.stderr
    assert "Fix:" in run.stderr and run.stdout == ""
    assert not (tmp_path / "out").exists()


def test_cli_tokenize_errors_exit_1(tmp_path, tiny_model_dir, capsys):
    assert (
        main(
            [
                "data",
                "tokenize",
                "--input",
                str(tmp_path / "nothing"),
                "--model",
                str(tiny_model_dir),
                "--output",
                str(tmp_path / "out"),
            ]
        )
        == 1
    )
    assert "no such directory" in capsys.readouterr().err
    prepared = tmp_path / "prep"
    write_jsonl(prepared / "train.jsonl", [chat("Q?", "A long answer that cannot fit at all.")])
    code = main(
        [
            "data",
            "tokenize",
            "--input",
            str(prepared),
            "--model",
            str(tiny_model_dir),
            "--output",
            str(tmp_path / "out"),
            "--max-length",
            "8",
            "--truncation",
            "error",
            "--num-proc",
            "1",
        ]
    )
    assert code == 1
    assert "train.jsonl:1: document has" in capsys.readouterr().err


def test_cli_prepare_flags_reach_the_library(tmp_path, capsys):
    src = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(50)] + [{"text": ""}]
    )
    code = main(
        [
            "data",
            "prepare",
            "--input",
            str(src),
            "--output",
            str(tmp_path / "out"),
            "--format",
            "prompt_completion",
            "--val-fraction",
            "0.2",
            "--seed",
            "3",
            "--max-reject-fraction",
            "0.05",
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (report["format"], report["val_fraction"], report["seed"]) == ("prompt_completion", 0.2, 3)
    assert report["reject_reasons"] == {"missing_field": 1}
    out = capsys.readouterr().out
    assert "51 read, 50 accepted, 1 rejected" in out
