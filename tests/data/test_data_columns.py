"""A column mapping (--columns, the pipeline's dataset_columns) for every format: rows whose columns have other
names are read without being rewritten first; the mapping names the format; a reject names the user's column."""

from __future__ import annotations

import json

import pytest
from data_helpers import read_jsonl, write_jsonl

from llmft.trainer.data.columns import FORMAT_FIELDS, apply_columns, mapped_format, parse_columns
from llmft.trainer.data.prepare import prepare_dataset
from llmft.trainer.errors import DataError

ANSWER = {"role": "assistant", "content": "Paris."}
QUESTION = {"role": "user", "content": "Capital of France?"}
EXPECTED = {"messages": [QUESTION, ANSWER]}

CASES = [
    # (format, mapping, a row in the user's own column names)
    ("messages", "messages:dialog", {"dialog": [QUESTION, ANSWER], "id": 1}),
    (
        "messages",
        "messages:dialog,role:speaker,content:text",
        {"dialog": [{"speaker": "user", "text": "Capital of France?"}, {"speaker": "assistant", "text": "Paris."}]},
    ),
    (
        "sharegpt",
        "conversations:turns",
        {"turns": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."}]},
    ),
    (
        "sharegpt",
        "conversations:turns,role:who,content:said",
        {"turns": [{"who": "human", "said": "Capital of France?"}, {"who": "gpt", "said": "Paris."}]},
    ),
    ("alpaca", "instruction:task,output:response", {"task": "Capital of France?", "response": "Paris."}),
    ("alpaca", "output:response", {"instruction": "Capital of France?", "input": "", "response": "Paris."}),
    ("prompt_completion", "prompt:question,completion:answer", {"question": "Capital of France?", "answer": "Paris."}),
    (
        "prompt_completion",
        "prompt:q,completion:a,role:r,content:c",
        {"q": [{"r": "user", "c": "Capital of France?"}], "a": [{"r": "assistant", "c": "Paris."}]},
    ),
    ("text", "text:body", {"body": "Paris is the capital of France.", "text": "an unrelated column"}),
]


@pytest.mark.parametrize(("fmt", "mapping", "row"), CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_every_format_reads_its_fields_from_mapped_columns(tmp_path, fmt, mapping, row):
    src = write_jsonl(tmp_path / "d.jsonl", [row, row])
    report = prepare_dataset(str(src), tmp_path / "out", columns=mapping, val_fraction=0.0)
    assert report["accepted"] == 2 and report["format"] == fmt, report
    assert report["columns"] == dict(item.split(":") for item in mapping.split(","))
    expected = {"text": "Paris is the capital of France."} if fmt == "text" else EXPECTED
    assert read_jsonl(tmp_path / "out" / "train.jsonl") == [expected, expected]


def test_without_the_mapping_those_rows_are_rejected(tmp_path):
    """The cases above are real: the same rows without --columns match no format."""
    rows = [row for fmt, _mapping, row in CASES if fmt == "prompt_completion"][:1]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match="no valid row"):
        prepare_dataset(str(src), tmp_path / "out")


def test_the_mapping_names_the_format_so_other_columns_do_not_decide(tmp_path):
    """A `messages` column of other data beside question/answer: auto-detection alone would read it."""
    row = {"question": "Capital of France?", "answer": "Paris.", "messages": "not a conversation"}
    src = write_jsonl(tmp_path / "d.jsonl", [row])
    report = prepare_dataset(str(src), tmp_path / "out", columns="prompt:question,completion:answer", val_fraction=0)
    assert report["accepted"] == 1 and report["format"] == "prompt_completion"


def test_a_missing_column_is_that_rows_reject_naming_the_column(tmp_path):
    good = {"question": "Capital of France?", "answer": "Paris."}
    src = write_jsonl(tmp_path / "d.jsonl", [good, good, {"question": "Capital of Spain?"}, {**good, "answer": ""}])
    prepare_dataset(str(src), tmp_path / "out", columns="prompt:question,completion:answer", max_reject_fraction=0.5)
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["line"], r["reason"], r["field"]) for r in rejects] == [
        (3, "missing_field", "answer"),
        (4, "empty_assistant_content", "answer"),
    ]
    assert "`answer` (mapped to completion)" in rejects[1]["message"]
    assert json.loads(rejects[0]["raw"]) == {"question": "Capital of Spain?"}  # the row as it was


def test_a_csv_cell_holding_a_mapped_conversation_is_parsed(tmp_path):
    dialog = json.dumps([QUESTION, ANSWER]).replace('"', '""')
    (tmp_path / "d.csv").write_text(f'id,dialog\n1,"{dialog}"\n', encoding="utf-8")
    report = prepare_dataset(str(tmp_path / "d.csv"), tmp_path / "out", columns="messages:dialog", val_fraction=0)
    assert report["accepted"] == 1
    assert read_jsonl(tmp_path / "out" / "train.jsonl") == [EXPECTED]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prompt=question", "is not field:column"),
        ("prompt:", "is not field:column"),
        ("question:prompt", "unknown field 'question'"),
        ("prompt:a,prompt:b", "mapped twice"),
        ("prompt:q,output:a", "maps fields of alpaca and prompt_completion"),
    ],
)
def test_a_bad_mapping_is_one_line_with_the_fix(text, message):
    with pytest.raises(DataError, match=message):
        parse_columns(text)


def test_a_mapping_and_a_format_that_disagree_are_refused(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"q": "x", "a": "y"}])
    with pytest.raises(DataError, match="maps prompt_completion fields, but the format is alpaca"):
        prepare_dataset(str(src), tmp_path / "out", columns="prompt:q,completion:a", format="alpaca")
    assert mapped_format(parse_columns("prompt:q,completion:a"), "prompt_completion") == "prompt_completion"
    assert mapped_format(parse_columns("role:r,content:c"), "auto") == "auto"
    assert not (tmp_path / "out").exists()


def test_each_field_belongs_to_one_format():
    fields = [field for names in FORMAT_FIELDS.values() for field in names]
    assert len(fields) == len(set(fields))


def test_apply_columns_keeps_unmapped_columns_and_lets_a_fields_own_column_give_way():
    row = {"response": "new", "output": "old", "instruction": "i", "meta": 1}
    assert apply_columns(row, parse_columns("output:response")) == {"instruction": "i", "meta": 1, "output": "new"}
    assert apply_columns(row, ()) is row
