"""prepare_dataset: deterministic split, quality gate, atomic outputs, streaming, hub sources."""

from __future__ import annotations

import json
import random
import tracemalloc

import pytest
from data_helpers import chat, read_jsonl, write_jsonl

import llmft.trainer.data.prepare as prepare_module
from llmft.demo import sample_names, sample_path
from llmft.trainer.data.prepare import prepare_dataset
from llmft.trainer.errors import DataError
from llmft.trainer.io import is_complete, sha256_file


def _rows(n: int) -> list[dict]:
    return [chat(f"Question number {i}?", f"Answer number {i}.") for i in range(n)]


def test_split_is_deterministic_order_independent_and_seeded(tmp_path):
    rows = _rows(400)
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    src_shuffled = write_jsonl(tmp_path / "b.jsonl", shuffled)
    r1 = prepare_dataset(str(src), tmp_path / "o1", val_fraction=0.1)
    r2 = prepare_dataset(str(src), tmp_path / "o2", val_fraction=0.1)
    r3 = prepare_dataset(str(src_shuffled), tmp_path / "o3", val_fraction=0.1)
    r4 = prepare_dataset(str(src), tmp_path / "o4", val_fraction=0.1, seed=1)
    val = {json.dumps(r) for r in read_jsonl(tmp_path / "o1" / "val.jsonl")}
    assert (tmp_path / "o1" / "train.jsonl").read_bytes() == (tmp_path / "o2" / "train.jsonl").read_bytes()
    assert {json.dumps(r) for r in read_jsonl(tmp_path / "o3" / "val.jsonl")} == val
    assert {json.dumps(r) for r in read_jsonl(tmp_path / "o4" / "val.jsonl")} != val
    assert 20 <= r1["splits"]["val"] <= 60 and r1["splits"]["train"] + r1["splits"]["val"] == 400
    assert r1["splits"] == r2["splits"] == r3["splits"]
    assert r4["seed"] == 1


def test_small_data_still_gets_a_validation_row(tmp_path):
    src = write_jsonl(tmp_path / "s.jsonl", _rows(3))
    report = prepare_dataset(str(src), tmp_path / "out", val_fraction=0.05)
    assert report["splits"] == {"train": 2, "val": 1}
    train, val = read_jsonl(tmp_path / "out" / "train.jsonl"), read_jsonl(tmp_path / "out" / "val.jsonl")
    assert sorted(map(json.dumps, train + val)) == sorted(map(json.dumps, _rows(3)))


def test_report_contents_and_source_hash(tmp_path):
    report = prepare_dataset(str(sample_path("alpaca_demo")), tmp_path / "out")
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk == report
    assert report["source_hash"] == sha256_file(sample_path("alpaca_demo"))
    assert (report["total_rows"], report["accepted"], report["rejected"]) == (503, 500, 3)
    assert report["reject_reasons"] == {"invalid_json": 1, "empty_assistant_content": 1, "missing_field": 1}
    assert report["format"] == "alpaca"
    assert is_complete(tmp_path / "out")


def test_shipped_samples_prepare_cleanly(tmp_path):
    assert sample_names() == [
        "alpaca_demo.jsonl",
        "chat_demo.jsonl",
        "velmora_facts.jsonl",
        "velmora_questions.jsonl",  # held-out questions (eval_questions), not a chat dataset
        "velmora_three_facts.jsonl",
    ]
    report = prepare_dataset(str(sample_path("chat_demo")), tmp_path / "chat")
    assert report["rejected"] == 0 and report["format"] == "messages"
    rows = read_jsonl(tmp_path / "chat" / "train.jsonl")
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    assert max(sum(m["role"] == "assistant" for m in r["messages"]) for r in rows) >= 2
    with pytest.raises(FileNotFoundError, match="alpaca_demo.jsonl"):
        sample_path("nope")


def test_no_valid_row_fails_naming_file_lines_field_and_fix(tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", ['{"oops"', {"instruction": "x"}, {"text": ""}])
    with pytest.raises(DataError) as info:
        prepare_dataset(str(src), tmp_path / "out")
    message = str(info.value)
    assert "no valid row among 3 rows" in message
    assert f"{src}:1: invalid_json" in message
    assert f"{src}:2: missing_field in `output`" in message
    assert f"{src}:3: empty_text" in message and "Fix:" in message
    assert not (tmp_path / "out").exists()


def test_reject_fraction_above_limit_fails_and_writes_nothing(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", _rows(98) + [{"text": ""}, {"messages": []}])
    with pytest.raises(DataError, match=r"2 of 100 rows rejected \(2\.00%\), above --max-reject-fraction 1\.00%"):
        prepare_dataset(str(src), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]
    report = prepare_dataset(str(src), tmp_path / "out", max_reject_fraction=0.02)
    assert report["rejected"] == 2


def test_injected_failure_leaves_no_partial_output(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "d.jsonl", _rows(200))
    real_convert = prepare_module.convert_row
    calls = {"n": 0}

    def exploding(row, fmt):
        calls["n"] += 1
        if calls["n"] == 150:
            raise RuntimeError("disk on fire")
        return real_convert(row, fmt)

    monkeypatch.setattr(prepare_module, "convert_row", exploding)
    with pytest.raises(RuntimeError, match="disk on fire"):
        prepare_dataset(str(src), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"], "temp files or a partial dir were left"

    monkeypatch.setattr(prepare_module, "convert_row", real_convert)
    prepare_dataset(str(src), tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    calls["n"] = 0
    monkeypatch.setattr(prepare_module, "convert_row", exploding)
    with pytest.raises(RuntimeError):
        prepare_dataset(str(src), tmp_path / "out")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before, "previous output was touched"


def _peak_python_memory(path, out, rows: int) -> tuple[int, int]:
    filler = "x" * 500
    with open(path, "w") as fh:
        for i in range(rows):
            fh.write(json.dumps(chat(f"Q{i} {filler}", f"A{i} {filler}")) + "\n")
    tracemalloc.start()
    try:
        report = prepare_dataset(str(path), out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report["accepted"] == rows
    return peak, path.stat().st_size


@pytest.mark.slow
@pytest.mark.parametrize("parallel_min_bytes", [1 << 20, 1 << 40], ids=["process-pool", "inline"])
def test_jsonl_is_streamed_not_loaded_whole(tmp_path, monkeypatch, parallel_min_bytes):
    monkeypatch.setattr(prepare_module, "PARALLEL_MIN_BYTES", parallel_min_bytes)
    small_peak, _ = _peak_python_memory(tmp_path / "small.jsonl", tmp_path / "o1", 3_000)
    big_peak, big_size = _peak_python_memory(tmp_path / "big.jsonl", tmp_path / "o2", 12_000)
    assert big_size > 12_000_000
    assert big_peak < 1.5 * small_peak + (1 << 20), f"memory grows with the input: {small_peak} -> {big_peak} bytes"
    assert big_peak < big_size / 2, f"peak Python memory {big_peak} bytes for a {big_size}-byte file"
    assert read_jsonl(tmp_path / "o2" / "train.jsonl")[:1] + read_jsonl(tmp_path / "o2" / "val.jsonl")[:1]


def test_bad_arguments_and_missing_source(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        prepare_dataset(str(tmp_path / "missing.jsonl"), tmp_path / "out")
    src = write_jsonl(tmp_path / "d.jsonl", _rows(2))
    with pytest.raises(DataError, match="--val-fraction"):
        prepare_dataset(str(src), tmp_path / "out", val_fraction=1.0)
    with pytest.raises(DataError, match="--format"):
        prepare_dataset(str(src), tmp_path / "out", format="yaml")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows found"):
        prepare_dataset(str(tmp_path / "empty.jsonl"), tmp_path / "out")


class _FakeLoad:
    """Stands in for datasets.load_dataset (no hub here): records the call, yields rows."""

    def __init__(self, rows=None, error=None):
        self.rows, self.error, self.calls = rows or [], error, []

    def __call__(self, path, **kwargs):
        self.calls.append((path, kwargs))
        if self.error:
            raise self.error
        return iter(self.rows)


def test_hub_id_streams_with_hf_token(tmp_path, monkeypatch):
    import datasets

    fake = _FakeLoad(rows=[{"instruction": "Add.", "input": "", "output": "4"}, {"instruction": "x", "output": ""}])
    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    report = prepare_dataset("tatsu-lab/alpaca", tmp_path / "out", split="train[:2]", max_reject_fraction=0.5)
    assert fake.calls == [("tatsu-lab/alpaca", {"split": "train[:2]", "streaming": True, "token": "hf_secret"})]
    assert report["source_kind"] == "hub" and report["hub_split"] == "train[:2]"
    assert [(r["line"], r["reason"]) for r in read_jsonl(tmp_path / "out" / "rejects.jsonl")] == [
        (2, "empty_assistant_content")
    ]
    assert "hf_secret" not in (tmp_path / "out" / "report.json").read_text()


def test_hub_offline_reads_the_cache_and_errors_explain(tmp_path, monkeypatch):
    import datasets

    fake = _FakeLoad(error=ConnectionError("offline"))
    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(DataError, match="offline: only the local datasets cache is read.*HF_TOKEN"):
        prepare_dataset("org/private-set", tmp_path / "out")
    assert fake.calls == [("org/private-set", {"split": "train", "streaming": False, "token": None})]
    assert not (tmp_path / "out").exists()


def test_process_pool_and_inline_give_identical_outputs(tmp_path, monkeypatch):
    rows = _rows(3000)
    for i in (5, 700, 2999):
        rows[i] = '{"broken' if i == 5 else {"messages": []}
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    inline = prepare_dataset(str(src), tmp_path / "inline")
    monkeypatch.setattr(prepare_module, "PARALLEL_MIN_BYTES", 0)
    pooled = prepare_dataset(str(src), tmp_path / "pooled")
    for name in ("train.jsonl", "val.jsonl", "rejects.jsonl"):
        assert (tmp_path / "inline" / name).read_bytes() == (tmp_path / "pooled" / name).read_bytes(), name
    assert [r["line"] for r in read_jsonl(tmp_path / "pooled" / "rejects.jsonl")] == [6, 701, 3000]
    assert {k: v for k, v in inline.items() if k != "seconds"} == {k: v for k, v in pooled.items() if k != "seconds"}
