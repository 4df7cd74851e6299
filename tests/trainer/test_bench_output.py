"""Where `llmft bench ...` writes: one default folder, ``benchmarks/results`` under the current directory
(from the checkout's root: beside the committed results, outside the package), and never half a file."""

from __future__ import annotations

import argparse
import importlib
import json
import os
from argparse import Namespace
from pathlib import Path

import pytest

from llmft.benchmarks import RESULTS_DIR, eval_threads, train_bench
from llmft.commands.bench import BENCHES

ARM = {"job": "project:qwen2.5-1.5b:lora", "label": "", "arm": "project", "model": "qwen2.5-1.5b", "method": "lora",
       "tokens_per_s": 1.0, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11"}  # fmt: skip


def _default_folder(module_name: str) -> str:
    parser = argparse.ArgumentParser()
    importlib.import_module(module_name).add_arguments(parser)
    args = parser.parse_args([])
    return args.results_dir if hasattr(args, "results_dir") else args.out


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_benchmark_writes_where_the_committed_results_are_by_default(name, repo_root):
    folder = _default_folder(BENCHES[name][0])
    assert Path(folder) == RESULTS_DIR and not Path(folder).is_absolute(), f"llmft bench {name} writes to {folder}"
    committed = repo_root / folder
    assert committed.is_dir() and not committed.is_symlink() and any(committed.glob("20*.json"))
    assert "llmft" not in committed.relative_to(repo_root).parts, "results are data: outside the package"


def test_the_default_folder_is_under_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = Namespace(out=_default_folder("llmft.benchmarks.train_bench"), merge_from="", profile="short")
    train_bench._write_outputs(Namespace(**vars(args), samples_per_step=64), {}, [ARM])
    assert [p.suffix for p in sorted((tmp_path / "benchmarks" / "results").iterdir())] == [".json", ".md"]


def _refuse_rename(monkeypatch):
    def refuse(src, dst):
        raise OSError(28, "No space left on device (test)")

    monkeypatch.setattr(os, "replace", refuse)


def test_a_failed_training_result_write_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    args = Namespace(out=str(tmp_path), merge_from="", profile="short", samples_per_step=64)
    train_bench._write_outputs(args, {}, [ARM])
    (earlier,) = tmp_path.glob("*.json")
    before = earlier.read_bytes()
    _refuse_rename(monkeypatch)
    with pytest.raises(OSError):
        train_bench._write_outputs(args, {}, [{**ARM, "tokens_per_s": 2.0}])
    assert earlier.read_bytes() == before and json.loads(before)["arms"][0]["tokens_per_s"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([earlier.name, earlier.with_suffix(".md").name])


def test_a_failed_eval_threads_write_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    args = Namespace(results_dir=str(tmp_path), model="random", layers=2, new_tokens=4, label="cpu")
    eval_threads._write([], args, None, (0.0, 0.0))
    (earlier,) = tmp_path.glob("*.json")
    before = earlier.read_bytes()
    _refuse_rename(monkeypatch)
    with pytest.raises(OSError):
        eval_threads._write([], Namespace(**{**vars(args), "new_tokens": 8}), None, (0.0, 0.0))
    assert earlier.read_bytes() == before and json.loads(before)["new_tokens"] == 4
    assert len(list(tmp_path.iterdir())) == 2, "no temporary file is left behind"
