"""A column mapping: read a dataset whose columns have other names, without rewriting it first.

``--columns prompt:question,completion:answer`` (the pipeline's ``dataset_columns``) says which column of the
user's rows holds which field of a supported format (llmft/trainer/data/formats.py), ``field:column`` pairs:

==================  ==========================================================================================
format              fields
==================  ==========================================================================================
messages            ``messages``
sharegpt            ``conversations``
alpaca              ``instruction``, ``input``, ``output``, ``system``
prompt_completion   ``prompt``, ``completion``
text                ``text``
(inside a turn)     ``role``, ``content``: the keys of each turn of messages / conversations (and of TRL-style
                    prompt/completion lists), e.g. ``messages:dialog,role:speaker,content:utterance``
==================  ==========================================================================================

The mapped fields name the format (they all belong to one; ``--format`` may say the same, not another one), so a
row's other columns never change how it is read. A column the mapping names but a row lacks is that row's
``missing_field`` reject, naming the column. Columns the mapping does not name are kept under their own names
(an alpaca set whose answer column is ``response`` maps ``output:response`` alone). A mapped messages or
conversations column that holds a JSON string (a CSV cell) is parsed.

The same mapping is applied by every reader of a source (local files, hub, https, s3, Langfuse) to the decoded row,
in the prepare workers, before the row's format is checked; rejects.jsonl quotes the row as it was.
"""

from __future__ import annotations

import json
from typing import Any

from llmft.trainer.data.formats import RowReject
from llmft.trainer.errors import DataError

FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "input", "output", "system"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
"""format -> the row fields a mapping may name (each field belongs to one format)."""
TURN_FIELDS = ("role", "content")
"""Keys inside each turn of a list of messages."""
_LIST_FIELDS = ("messages", "conversations", "prompt", "completion")
_JSON_LIST_FIELDS = ("messages", "conversations")
_FIELD_FORMAT = {field: fmt for fmt, fields in FORMAT_FIELDS.items() for field in fields}
EXAMPLE = "prompt:question,completion:answer"

Columns = tuple[tuple[str, str], ...]
"""(field, column) pairs, in the order given."""


def parse_columns(text: str, *, where: str = "--columns") -> Columns:
    """``field:column,field:column`` -> pairs; '' -> (). DataError (one line, the fix) on anything else."""
    pairs: list[tuple[str, str]] = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        field, sep, column = (part.strip() for part in item.partition(":"))
        if not sep or not field or not column:
            raise DataError(f"{where} {text!r}: {item.strip()!r} is not field:column; e.g. {EXAMPLE}")
        if field not in _FIELD_FORMAT and field not in TURN_FIELDS:
            known = ", ".join([*_FIELD_FORMAT, *TURN_FIELDS])
            raise DataError(f"{where} {text!r}: unknown field {field!r}; map one of {known} (field:column)")
        if field in dict(pairs):
            raise DataError(f"{where} {text!r}: field {field!r} is mapped twice; keep one column for it")
        pairs.append((field, column))
    columns = tuple(pairs)
    if columns:
        mapped_format(columns, where=where)
    return columns


def mapped_format(columns: Columns, requested: str = "auto", *, where: str = "--columns") -> str:
    """The format the mapped fields name ('auto' when only turn keys are mapped); DataError when they name two
    formats, or another than ``requested``."""
    formats = sorted({_FIELD_FORMAT[field] for field, _ in columns if field in _FIELD_FORMAT})
    text = ",".join(f"{field}:{column}" for field, column in columns)
    if len(formats) > 1:
        each = "; ".join(f"{fmt}: {', '.join(fields)}" for fmt, fields in FORMAT_FIELDS.items())
        raise DataError(
            f"{where} {text!r}: maps fields of {' and '.join(formats)}; a mapping names the fields of one format "
            f"({each})"
        )
    if requested not in ("auto", *formats) and formats:
        raise DataError(
            f"{where} {text!r} maps {formats[0]} fields, but the format is {requested}; drop --format (the "
            "mapping names the format) or map that format's fields"
        )
    return formats[0] if formats else requested


def apply_columns(row: Any, columns: Columns) -> Any:
    """``row`` with each mapped column renamed to its field (a field's own column, if any, gives way)."""
    if not columns or not isinstance(row, dict):
        return row
    renamed = {column for field, column in columns if field in _FIELD_FORMAT}
    out = {key: value for key, value in row.items() if key not in renamed}
    for field, column in columns:
        if field in _FIELD_FORMAT:
            out.pop(field, None)
            if column in row:
                out[field] = _maybe_json_list(field, row[column])
    turn_keys = [(field, column) for field, column in columns if field in TURN_FIELDS]
    if turn_keys:
        for field in _LIST_FIELDS:
            if isinstance(out.get(field), list):
                out[field] = [_rename_turn(turn, turn_keys) for turn in out[field]]
    return out


def _maybe_json_list(field: str, value: Any) -> Any:
    if field in _JSON_LIST_FIELDS and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value
    return value


def _rename_turn(turn: Any, turn_keys: list[tuple[str, str]]) -> Any:
    if not isinstance(turn, dict):
        return turn
    renamed = {column for _field, column in turn_keys}
    out = {key: value for key, value in turn.items() if key not in renamed}
    for field, column in turn_keys:
        if column in turn:
            out[field] = turn[column]
    return out


def name_columns(reject: RowReject, columns: Columns) -> RowReject:
    """A reject of a mapped field, told in the user's column names: `question (prompt)` rather than `prompt`."""
    head = reject.field.split("[", 1)[0].split(".", 1)[0]
    fields = dict(columns)
    if head not in fields or head not in _FIELD_FORMAT:
        return reject
    column = fields[head]
    detail = reject.detail.replace(f"`{head}`", f"`{column}` (mapped to {head})")
    return RowReject(reject.reason, column + reject.field[len(head) :], detail)
