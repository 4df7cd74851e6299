"""Every reject reason, with its 1-based source line, in rejects.jsonl and report.json."""

from __future__ import annotations

import csv
import json

import pytest
from data_helpers import chat, read_jsonl, write_jsonl

from llmft.trainer.data.formats import REJECT_FIXES
from llmft.trainer.data.prepare import prepare_dataset

GOOD = chat("What is two plus two?", "Four.")


def _msgs(*roles: str) -> dict:
    return {"messages": [{"role": role, "content": f"{role} {i}"} for i, role in enumerate(roles)]}


# (raw line, reason, field) — each written between good rows
BAD_ROWS = [
    ('{"messages": [{"role": "user", "content": "hi"}', "invalid_json", "<line>"),
    ('{"text": "caf\udce9"}', "not_utf8", "<line>"),  # written as the Latin-1 byte 0xe9 (surrogateescape)
    ('{"text": "first", "text": "second"}', "duplicate_key", "text"),
    ("[1, 2, 3]", "wrong_type", "<row>"),
    (json.dumps({"question": "q", "answer": "a"}), "missing_field", "<row>"),
    (json.dumps({"instruction": "Say hi."}), "missing_field", "output"),
    (
        json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}),
        "missing_field",
        "messages[0].content",
    ),
    (json.dumps({"messages": "hello"}), "wrong_type", "messages"),
    (
        json.dumps({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}),
        "wrong_type",
        "messages[0].content",
    ),
    (json.dumps({"instruction": "Say hi.", "output": 3}), "wrong_type", "output"),
    (
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}),
        "unknown_role",
        "messages[1].role",
    ),
    (
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "a"}]}),
        "unknown_role",
        "conversations[1].from",
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}),
        "empty_assistant_content",
        "messages[1].content",
    ),
    (json.dumps({"prompt": "q", "completion": ""}), "empty_assistant_content", "completion"),
    (
        json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}),
        "no_assistant_turn",
        "messages",
    ),
    (json.dumps({"messages": []}), "empty_conversation", "messages"),
    (json.dumps({"conversations": []}), "empty_conversation", "conversations"),
    (json.dumps({"instruction": " ", "output": "x"}), "empty_prompt", "instruction"),
    (json.dumps({"text": ""}), "empty_text", "text"),
    (json.dumps({"text": "x" * 5000}), "row_too_large", "<row>"),  # the test passes max_row_bytes=4096
    ('{"text": ' + "[" * 2000 + "]" * 2000 + "}", "too_deep", "<line>"),  # 4,010 bytes: under max_row_bytes
    (json.dumps(_msgs("user", "assistant", "system")), "misplaced_system", "messages[2].role"),
    (json.dumps(_msgs("system", "user", "system", "assistant")), "misplaced_system", "messages[2].role"),
    (json.dumps(_msgs("assistant", "user", "assistant")), "assistant_first", "messages[0].role"),
    (json.dumps(_msgs("system", "assistant")), "assistant_first", "messages[1].role"),
    (json.dumps(_msgs("user", "user", "assistant")), "roles_not_alternating", "messages[1].role"),
    (json.dumps(_msgs("user", "assistant", "assistant")), "roles_not_alternating", "messages[2].role"),
    (
        json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q"}]}),
        "no_assistant_turn",
        "conversations",
    ),
    (
        json.dumps({"conversations": [{"from": "human", "value": "q"}] * 2 + [{"from": "gpt", "value": "a"}]}),
        "roles_not_alternating",
        "conversations[1].from",
    ),
    (json.dumps(_msgs("user", "assistant", "user")), "last_turn_not_assistant", "messages[2].role"),
]


def test_every_reason_is_reported_with_its_line(tmp_path):
    lines, expected = [], []
    for raw, reason, field in BAD_ROWS:
        lines.append(GOOD)
        lines.append("")  # blank lines are skipped but still counted in line numbers
        lines.append(raw)
        expected.append((len(lines), reason, field))
    src = tmp_path / "bad.jsonl"
    src.write_bytes(
        ("\n".join(r if isinstance(r, str) else json.dumps(r) for r in lines) + "\n").encode(errors="surrogateescape")
    )
    report = prepare_dataset(str(src), tmp_path / "out", max_reject_fraction=1.0, val_fraction=0.0, max_row_bytes=4096)
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["line"], r["reason"], r["field"]) for r in rejects] == expected
    assert all(r["file"] == str(src) and r["fix"] == REJECT_FIXES[r["reason"]] and r["message"] for r in rejects)
    assert set(REJECT_FIXES) == {reason for _, reason, _ in BAD_ROWS}, "a reason is untested"
    assert report["accepted"] == len(BAD_ROWS) and report["rejected"] == len(BAD_ROWS)
    assert report["reject_reasons"]["unknown_role"] == 2 and report["reject_reasons"]["missing_field"] == 3
    assert report["reject_reasons"]["roles_not_alternating"] == 3 and report["max_row_bytes"] == 4096
    assert rejects[0]["raw"].startswith('{"messages": [{"role": "user"')


def test_csv_rejects_carry_the_file_line(tmp_path):
    path = tmp_path / "data.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["instruction", "input", "output"])
        writer.writerow(["Add.", "2 and 2", "4"])
        writer.writerow(["Name a color.", "", ""])  # line 3: empty output
        writer.writerow(["Say hi.", "", "Hi."])
    report = prepare_dataset(str(path), tmp_path / "out", max_reject_fraction=0.5, val_fraction=0.0)
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["line"], r["reason"]) for r in rejects] == [(3, "empty_assistant_content")]
    assert report["accepted"] == 2


def test_csv_messages_column_holding_json(tmp_path):
    path = tmp_path / "chat.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["messages"])
        writer.writerow([json.dumps(GOOD["messages"])])
    prepare_dataset(str(path), tmp_path / "out", val_fraction=0.0)
    assert read_jsonl(tmp_path / "out" / "train.jsonl") == [GOOD]


def test_parquet_rejects_carry_the_row_number(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["a", "b", "c", "d"], "completion": ["1", "", "3", "4"]})
    pq.write_table(table, tmp_path / "data.parquet")
    prepare_dataset(str(tmp_path / "data.parquet"), tmp_path / "out", max_reject_fraction=0.5, val_fraction=0.0)
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["line"], r["reason"], r["field"]) for r in rejects] == [(2, "empty_assistant_content", "completion")]
    assert len(read_jsonl(tmp_path / "out" / "train.jsonl")) == 3


def test_json_array_and_folder_sources(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps([GOOD, {"text": ""}]))
    write_jsonl(folder / "sub" / "b.jsonl", [{"text": "hello"}])
    (folder / ".hidden.jsonl").write_text("not json\n")
    (folder / "notes.md").write_text("ignored")
    report = prepare_dataset(str(folder), tmp_path / "out", max_reject_fraction=0.5, val_fraction=0.0)
    assert report["source_kind"] == "folder"
    assert report["source_files"] == ["a.json", "sub/b.jsonl"]
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["file"], r["line"], r["reason"]) for r in rejects] == [("a.json", 2, "empty_text")]
    assert read_jsonl(tmp_path / "out" / "train.jsonl") == [GOOD, {"text": "hello"}]


def test_output_inside_the_input_folder_is_not_read_back(tmp_path):
    folder = tmp_path / "data"
    write_jsonl(folder / "rows.jsonl", [GOOD, {"text": "hello"}])
    first = prepare_dataset(str(folder), folder / "prepared", val_fraction=0.0)
    second = prepare_dataset(str(folder), folder / "prepared", val_fraction=0.0)
    assert first["source_files"] == second["source_files"] == ["rows.jsonl"]
    assert second["accepted"] == 2 and first["source_hash"] == second["source_hash"]
