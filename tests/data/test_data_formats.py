"""Golden conversions: every accepted format -> the canonical schema, through prepare_dataset."""

from __future__ import annotations

import json

import pytest
from data_helpers import read_jsonl, write_jsonl

from llmft.trainer.data.formats import RowReject, convert_row, detect_format
from llmft.trainer.data.prepare import prepare_dataset

U, A, S = "user", "assistant", "system"


def _m(*pairs):
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


GOLDEN = [
    (
        "messages",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Bye."},
            ]
        },
        _m((S, "Be brief."), (U, "Hi"), (A, "Hello."), (U, "Bye"), (A, "Bye.")),
    ),
    (
        "messages",  # OpenAI content parts, extra keys dropped
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Yo", "name": "bot"},
            ],
            "id": 7,
        },
        _m((U, "Hi there"), (A, "Yo")),
    ),
    (
        "sharegpt",
        {
            "conversations": [
                {"from": "system", "value": "Sys"},
                {"from": "human", "value": "Q1"},
                {"from": "gpt", "value": "A1"},
                {"from": "human", "value": "Q2"},
                {"from": "gpt", "value": "A2"},
            ]
        },
        _m((S, "Sys"), (U, "Q1"), (A, "A1"), (U, "Q2"), (A, "A2")),
    ),
    ("alpaca", {"instruction": "Add.", "input": "2 and 2", "output": "4"}, _m((U, "Add.\n\n2 and 2"), (A, "4"))),
    ("alpaca", {"instruction": "Name a color.", "input": "", "output": "Red."}, _m((U, "Name a color."), (A, "Red."))),
    (
        "alpaca",
        {"instruction": "Name a color.", "output": "Red.", "system": "Be kind."},
        _m((S, "Be kind."), (U, "Name a color."), (A, "Red.")),
    ),
    ("prompt_completion", {"prompt": "Hello", "completion": " World"}, _m((U, "Hello"), (A, " World"))),
    (
        "prompt_completion",  # TRL conversational prompt/completion
        {
            "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
            "completion": [{"role": "assistant", "content": "A"}],
        },
        _m((S, "S"), (U, "Q"), (A, "A")),
    ),
    ("text", {"text": "Plain text to learn."}, {"text": "Plain text to learn."}),
]


@pytest.mark.parametrize(("fmt", "row", "expected"), GOLDEN, ids=[f"{g[0]}-{i}" for i, g in enumerate(GOLDEN)])
def test_golden_conversion_auto_and_explicit(tmp_path, fmt, row, expected):
    for requested in ("auto", fmt):
        src = write_jsonl(tmp_path / f"{requested}.jsonl", [row])
        out = tmp_path / f"out-{requested}"
        report = prepare_dataset(str(src), out, format=requested, val_fraction=0.0)
        assert read_jsonl(out / "train.jsonl") == [expected]
        assert report["format"] == fmt
        assert report["formats"] == {fmt: 1}
        assert (out / "val.jsonl").read_text() == ""


def test_mixed_formats_are_fine_when_every_row_is_valid(tmp_path):
    rows = [GOLDEN[0][1], GOLDEN[2][1], GOLDEN[3][1], GOLDEN[6][1], GOLDEN[8][1]]
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    report = prepare_dataset(str(src), tmp_path / "out", val_fraction=0.0)
    assert report["format"] == "mixed"
    assert report["formats"] == {"messages": 1, "sharegpt": 1, "alpaca": 1, "prompt_completion": 1, "text": 1}
    assert read_jsonl(tmp_path / "out" / "train.jsonl") == [GOLDEN[i][2] for i in (0, 2, 3, 6, 8)]


def test_explicit_format_rejects_rows_of_another_format():
    with pytest.raises(RowReject) as info:
        convert_row({"text": "hello"}, "alpaca")
    assert (info.value.reason, info.value.field) == ("missing_field", "instruction")


def test_detect_format_names_the_expected_keys():
    assert detect_format({"conversations": []}) == "sharegpt"
    assert detect_format({"output": "x"}) == "alpaca"
    with pytest.raises(RowReject) as info:
        detect_format({"question": "q", "answer": "a"})
    assert info.value.reason == "missing_field"
    assert "answer, question" in info.value.detail and "instruction+output" in info.value.detail


def test_canonical_rows_are_compact_json_with_unicode_kept(tmp_path):
    src = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "Grüße", "completion": "日本語"}])
    prepare_dataset(str(src), tmp_path / "out", val_fraction=0.0)
    line = (tmp_path / "out" / "train.jsonl").read_text(encoding="utf-8").strip()
    assert line == json.dumps(_m((U, "Grüße"), (A, "日本語")), ensure_ascii=False, separators=(",", ":"))


def test_canonical_bytes_do_not_depend_on_orjson(monkeypatch):
    import llmft.trainer.data.prepare as prepare_module

    row = _m((U, 'a"b\\c\n\t\r\b\f\x00\x1f\x7f é日本😀 \u2028 </script>'), (A, "ok"))
    fast = prepare_module.canonical_line(row)
    monkeypatch.setattr(prepare_module, "_fast_dumps", None)
    assert prepare_module.canonical_line(row) == fast
    assert fast == json.dumps(row, ensure_ascii=False, separators=(",", ":")).encode()


def test_lone_surrogate_is_rejected_not_crashing(tmp_path):
    src = write_jsonl(
        tmp_path / "s.jsonl", [{"text": "fine"}, '{"text": "broken \\ud800 text"}', {"text": "also fine"}]
    )
    report = prepare_dataset(str(src), tmp_path / "out", max_reject_fraction=0.5, val_fraction=0.0)
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["line"], r["reason"]) for r in rejects] == [(2, "invalid_json")]
    assert "surrogate" in rejects[0]["message"] and report["accepted"] == 2
