"""Bad input that crashed (exit 3), was retried as permanent, or was read back (issue 35 items 6-8):
each is now one named row reject, one line naming the file, or exit 200 for a hub that does not
answer. docs/failure-modes.md ("Bad input and unreachable hubs") has a row per test."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_helpers import chat, read_jsonl, write_jsonl
from huggingface_hub.errors import OfflineModeIsEnabled

from llmft.trainer.data.prepare import prepare_dataset
from llmft.trainer.data.shards import open_split, write_split
from llmft.trainer.errors import EXIT_TRANSIENT, DataError
from llmft.trainer.hf_files import hub_unreachable


def _deep(levels: int) -> str:
    return '{"messages": ' + "[" * levels + "]" * levels + "}"


def _rows(n: int) -> list:
    return [chat(f"Question {i}?", f"Answer {i}.") for i in range(n)]


def test_a_row_nested_past_the_parsers_limit_is_one_rejected_row(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [*_rows(8), _deep(2_000), *_rows(8), _deep(100_000), *_rows(4)])
    report = prepare_dataset(str(source), tmp_path / "out", val_fraction=0.0, max_reject_fraction=0.2)
    assert (report["accepted"], report["rejected"], report["reject_reasons"]) == (20, 2, {"too_deep": 2})
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["line"], r["reason"]) for r in rejects] == [(9, "too_deep"), (18, "too_deep")]
    assert all(len(r["raw"]) <= 203 for r in rejects) and "flatten the row" in rejects[0]["fix"]  # 200 + "..."


def test_a_json_array_file_nested_too_deep_is_one_error_naming_it(tmp_path):
    source = tmp_path / "in.json"
    source.write_text("[" + json.dumps(chat("Q?", "A.")) + "," + _deep(5_000) + "]")
    with pytest.raises(DataError, match=r"in.json: JSON nested deeper .*write it as JSON Lines"):
        prepare_dataset(str(source), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_outputs_llmft_wrote_inside_the_input_folder_are_not_read_back(tmp_path, caplog):
    """A second prepare of the same folder into a sibling output read the first output's train, val and
    rejects back: rows doubled and validation rows leaked into train."""
    folder = tmp_path / "data"
    write_jsonl(folder / "rows.jsonl", _rows(40))
    first = prepare_dataset(str(folder), folder / "prepared-a", val_fraction=0.25)
    second = prepare_dataset(str(folder), folder / "prepared-b", val_fraction=0.25)
    assert first["accepted"] == second["accepted"] == 40 and second["source_files"] == ["rows.jsonl"]
    assert second["source_hash"] == first["source_hash"]
    validation = {json.dumps(r) for r in read_jsonl(folder / "prepared-a" / "val.jsonl")}
    assert not validation & {json.dumps(r) for r in read_jsonl(folder / "prepared-b" / "train.jsonl")}
    assert any("prepared-a: written by llmft (prepared-dataset); not read as input" in m for m in caplog.messages)


def _split(tmp_path: Path) -> Path:
    directory = tmp_path / "tok" / "train"
    write_split(directory, np.arange(8), np.arange(8), np.array([0, 4, 8]), np.array([0, 1, 2]))
    assert len(open_split(tmp_path / "tok", "train")) == 2
    return directory


def test_a_pickled_object_array_shard_is_refused_naming_it_and_never_unpickled(tmp_path):
    directory = _split(tmp_path)
    np.save(directory / "labels.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match=r"train/labels.npy: not a readable tokenized array .*Re-run `llmft data"):
        open_split(tmp_path / "tok", "train")


@pytest.mark.parametrize("damage", ["truncated", "float", "2-D"])
def test_a_truncated_or_foreign_shard_is_one_error_naming_it(tmp_path, damage):
    directory = _split(tmp_path)
    path = directory / "input_ids.npy"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-8])
    else:
        np.save(path, np.zeros(8, dtype=np.float32) if damage == "float" else np.zeros((2, 4), dtype=np.int32))
    with pytest.raises(DataError, match=r"train/input_ids.npy: not a readable tokenized array") as info:
        open_split(tmp_path / "tok", "train")
    assert "\n" not in str(info.value)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_refused_connection_anywhere_in_the_chain_is_transient_a_missing_repo_is_not():
    try:
        socket.create_connection(("127.0.0.1", _closed_port()), timeout=5)
    except ConnectionRefusedError as refused:
        try:
            raise OSError("We couldn't connect to the hub to load the files") from refused
        except OSError as wrapped:
            assert "ConnectionRefusedError" in hub_unreachable(wrapped)
    assert hub_unreachable(OSError("acme/nothere is not a local folder and is not a valid model identifier")) is None
    try:  # HF_HUB_OFFLINE=1 without the files: huggingface_hub's OfflineModeIsEnabled is a ConnectionError
        raise OSError("cannot find the requested files in the local cache") from OfflineModeIsEnabled("offline")
    except OSError as offline:
        assert hub_unreachable(offline) is None


@pytest.mark.slow
def test_an_unreachable_hub_is_one_line_exit_200(tmp_path, prepared_sample):
    """HF_ENDPOINT on a closed loopback port: huggingface_hub retries (about 24 s) without a line per retry,
    then one line, exit 200 (was exit 1 after ten retry lines: a transient fault that was never retried)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_HOME=str(tmp_path / "hf"))
    run = subprocess.run(
        [sys.executable, "-m", "llmft", "data", "tokenize", "--input", str(prepared_sample), "--model",
         "acme/not-cached", "--output", str(tmp_path / "tok")],
        capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert run.returncode == EXIT_TRANSIENT, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.strip() and "rows/s" not in line]
    assert len(errors) == 1 and errors[0].startswith("error: model='acme/not-cached': the Hugging Face hub did not")
    assert "ConnectError" in errors[0] and "exit 200" in errors[0] and not (tmp_path / "tok").exists()
