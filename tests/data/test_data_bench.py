"""The data benchmark still runs end to end (tiny row count; no timing is asserted)."""

from __future__ import annotations

import argparse
import json

import pytest

from llmft.benchmarks import data_bench

pytestmark = pytest.mark.slow  # runs the data benchmark with its process pool


def test_data_bench_smoke(tmp_path, tiny_model_dir, capsys):
    parser = argparse.ArgumentParser()
    data_bench.add_arguments(parser)
    args = parser.parse_args(
        ["--rows", "300", "--model", str(tiny_model_dir), "--num-proc", "2", "--results-dir", str(tmp_path)]
    )
    assert data_bench.run(args) == 0
    [json_path] = tmp_path.glob("*-cpu-data.json")
    record = json.loads(json_path.read_text())
    [result] = record["results"]
    assert result["model"] == str(tiny_model_dir) and result["tokens_match"] is True
    assert result["project"]["documents"] == result["naive"]["documents"] == 300
    assert result["project"]["packing_efficiency"] > 0.9
    assert {"machine", "date", "command", "rows", "load_average_before_after"} <= set(record)
    assert record["command"] == f"llmft bench data --rows 300 --model {tiny_model_dir} --max-length 2048 --num-proc 2"
    table = (tmp_path / json_path.name.replace(".json", ".md")).read_text()
    assert f"| {tiny_model_dir} |" in table and "speedup" in table
    assert "results:" in capsys.readouterr().out
    first_seconds = result["project"]["seconds"]
    assert data_bench.run(args) == 0  # a second run the same day keeps the first in previous_runs
    record = json.loads(json_path.read_text())
    assert [r["project_seconds"] for r in record["previous_runs"][0]["results"]] == [first_seconds]
    assert "Earlier runs the same day" in (tmp_path / json_path.name.replace(".json", ".md")).read_text()
