"""Data that is not UTF-8 JSON Lines, rows with a key written twice, and rows nested without bound in any
source (issue 35, the Low items): one line naming the file, line and fix, or one named reject per row.
docs/failure-modes.md has a row per test."""

from __future__ import annotations

import json

import pytest
from data_helpers import chat, read_jsonl
from test_data_failures import assert_one_line_error, in_process

from llmft.trainer.data.prepare import prepare_dataset
from llmft.trainer.errors import DataError


def _lines(n: int, answer: str = "Answer") -> list[str]:
    return [json.dumps(chat(f"Question {i}?", f"{answer} {i}."), ensure_ascii=False) for i in range(n)]


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ("\n".join(_lines(50, "Réponse")).encode("latin-1"), "in.jsonl:1: not UTF-8 text (byte 0xe9 at offset"),
        (bytes(range(256)) * 20, "in.jsonl:1: not UTF-8 text (a NUL byte at offset 0"),
        ("\n".join(_lines(50)).encode("utf-16-le"), "in.jsonl:1: not UTF-8 text (a NUL byte at offset 1"),
        (bytes(b for b in range(256) if b != 10) * 40_000, "in.jsonl:1: not UTF-8 text (byte 0x80 at offset 127"),
    ],
    ids=["latin-1", "binary", "utf-16-without-bom", "10-mb-binary-without-a-newline"],
)
def test_binary_or_latin1_data_is_one_line_naming_file_line_and_fix(tmp_path, capsys, data, needle):
    (tmp_path / "in.jsonl").write_bytes(data)
    run = in_process(capsys, "data", "prepare", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"))
    line = assert_one_line_error(run, 1, needle, "re-save it as UTF-8, e.g. `iconv -f latin1 -t utf-8")
    assert "First offending lines" not in run.stderr and str(tmp_path / "in.jsonl") in line
    assert not (tmp_path / "o").exists()


def test_latin1_rows_after_utf8_ones_are_rejected_or_one_line(tmp_path, capsys):
    """A UTF-8 file with a few Latin-1 rows: each is a `not_utf8` reject within the limit; past it, one line
    naming the first such row (not the five-row listing)."""
    lines = _lines(200)
    lines[120] = lines[120].replace("Answer", "Réponse")
    source = tmp_path / "in.jsonl"
    source.write_bytes(
        b"\n".join(line.encode("latin-1") if i == 120 else line.encode() for i, line in enumerate(lines))
    )
    report = prepare_dataset(str(source), tmp_path / "ok", val_fraction=0.0)
    assert (report["accepted"], report["reject_reasons"]) == (199, {"not_utf8": 1})
    (reject,) = read_jsonl(tmp_path / "ok" / "rejects.jsonl")
    assert (reject["line"], reject["field"]) == (121, "<line>") and "iconv" in reject["fix"]

    lines[130] = lines[130].replace("Answer", "Réponse")
    lines[140] = "{not json"
    source.write_bytes(b"\n".join(line.encode("latin-1") for line in lines))
    run = in_process(capsys, "data", "prepare", "--input", str(source), "--output", str(tmp_path / "o"))
    assert_one_line_error(
        run, 1, "in.jsonl:121: not UTF-8 text (byte 0xe9 at offset", "2 of 200 rows", "are not UTF-8 (and 1 rejected"
    )


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_utf16_jsonl_is_one_line_re_save_as_utf8_not_a_truncated_row_and_a_phantom_one(tmp_path, encoding):
    """Python's "utf-16"/"utf-32" codecs write a byte order mark; the file was split at its 0x0A bytes into
    a "truncated data" row 1 and a phantom row 51. JSON Lines is UTF-8: refused, naming file and fix."""
    source = tmp_path / "in.jsonl"
    data = ("\n".join(_lines(50)) + "\n").encode(encoding)
    source.write_bytes(data if encoding != "utf-16-be" else b"\xfe\xff" + data)
    family = "UTF-32" if "32" in encoding else "UTF-16"
    with pytest.raises(DataError) as error:
        prepare_dataset(str(source), tmp_path / "out")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{source}:1: {family} text (byte order mark)")
    assert "JSON Lines must be UTF-8" in message and "iconv -f utf-" in message
    assert not (tmp_path / "out").exists()


def test_a_key_written_twice_rejects_its_row_naming_the_key(tmp_path):
    """JSON parsers keep the last of two equal keys silently: the row's first conversation was dropped."""
    twice = (
        '{"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}], '
        '"messages": [{"role": "user", "content": "Other?"}, {"role": "assistant", "content": "B."}]}'
    )
    inner = (
        '{"messages": [{"role": "user", "content": "Q?", "content" : "R?"}, {"role": "assistant", "content": "A."}]}'
    )
    lookalike = json.dumps(chat('He said "x": y', 'and "content": twice, "content" :'))  # quotes and colons in text
    lines = [*_lines(10), twice, *_lines(5), inner, lookalike]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    report = prepare_dataset(str(source), tmp_path / "out", val_fraction=0.0, max_reject_fraction=0.2)
    assert (report["accepted"], report["reject_reasons"]) == (16, {"duplicate_key": 2})
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["line"], r["field"]) for r in rejects] == [(11, "messages"), (17, "content")]
    assert "key `messages` appears twice in one object" in rejects[0]["message"] and "once" in rejects[0]["fix"]

    array = tmp_path / "in.json"
    array.write_text("[" + ", ".join([*_lines(3), twice]) + "]")
    with pytest.raises(
        DataError, match=r"in.json: key `messages` appears twice in one object;.*write each key once per object"
    ):
        prepare_dataset(str(array), tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_rows_nested_without_bound_in_csv_hub_or_json_sources_are_too_deep_rejects(tmp_path, monkeypatch):
    """A CSV cell of 5,000 brackets crashed prepare (RecursionError, exit 3), as did a hub or Langfuse row
    whose hash serialises it; each is now one too_deep reject with its line, like a JSONL line."""
    from llmft.trainer.data import sources
    from llmft.trainer.data.limits import MAX_ROW_DEPTH

    good = [json.dumps(chat(f"Q{i}?", f"A{i}.")["messages"]) for i in range(8)]
    csv_file = tmp_path / "in.csv"
    cells = [*good[:4], "[" * 5000 + "]" * 5000, *good[4:], "[" * (MAX_ROW_DEPTH + 1) + "]" * (MAX_ROW_DEPTH + 1)]
    csv_file.write_text("messages\n" + "\n".join(f'"{c.replace(chr(34), chr(34) * 2)}"' for c in cells) + "\n")
    report = prepare_dataset(str(csv_file), tmp_path / "csv", val_fraction=0.0, max_reject_fraction=0.5)
    assert (report["accepted"], report["reject_reasons"]) == (8, {"too_deep": 2})
    rejects = read_jsonl(tmp_path / "csv" / "rejects.jsonl")
    assert [r["line"] for r in rejects] == [6, 11] and "column `messages` nests" in rejects[0]["message"]

    hub_rows = [chat(f"Q{i}?", f"A{i}.") for i in range(8)] + [{"messages": _nested(50_000)}]
    monkeypatch.setattr(sources, "load_hub_dataset", lambda spec, split, config="": iter(hub_rows))
    report = prepare_dataset("org/deep", tmp_path / "hub", val_fraction=0.0, max_reject_fraction=0.2)
    assert (report["accepted"], report["reject_reasons"]) == (8, {"too_deep": 1})
    (reject,) = read_jsonl(tmp_path / "hub" / "rejects.jsonl")
    assert reject["line"] == 9 and reject["raw"] == "null"  # the row itself is never serialised

    array = tmp_path / "in.json"
    array.write_text(json.dumps([chat("Q?", "A."), {"messages": _nested(MAX_ROW_DEPTH + 1)}, chat("R?", "B.")]))
    report = prepare_dataset(str(array), tmp_path / "json", val_fraction=0.0, max_reject_fraction=0.5)
    assert (report["accepted"], report["reject_reasons"]) == (2, {"too_deep": 1})
