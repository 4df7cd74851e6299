"""``llmft data prepare``: any dataset -> validated JSONL in one canonical schema.

Reads a source row by row (see :mod:`llmft.trainer.data.sources`; an ``https://`` or
``s3://`` source is fetched first, into the folder being built: :mod:`llmft.trainer.data.remote`),
renames mapped columns (:mod:`llmft.trainer.data.columns`), validates and
converts each row (:mod:`llmft.trainer.data.formats`), and writes, all inside one
temporary directory that is renamed into place only when everything passed::

    DIR/train.jsonl     canonical rows ({"messages": [...]} or {"text": ...})
    DIR/val.jsonl       the deterministic validation share
    DIR/rejects.jsonl   one object per rejected row: file, line, reason, field, message, fix, raw
    DIR/report.json     counts, reasons, detected format, source hash

The split is decided per row by a salted hash of its canonical JSON, so it does
not depend on row order or on the size of the file, and duplicate rows always
land on the same side (no train/val leakage through duplicates).

Nothing is lost: ``output_dir`` is replaced only when it is absent, empty or an
earlier prepared dataset (our owner marker), unless ``force``; the input itself,
or a folder holding it, is never the output. A row above ``max_row_bytes`` is
rejected (``row_too_large``) without being held in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from llmft.trainer.data.columns import Columns, apply_columns, mapped_format, name_columns, parse_columns
from llmft.trainer.data.formats import (
    FORMAT_CHOICES,
    RowReject,
    convert_row,
    deeper_than,
    may_repeat_a_key,
    refuse_duplicate_keys,
)
from llmft.trainer.data.limits import DEFAULT_MAX_REJECT_FRACTION, DEFAULT_MAX_ROW_BYTES, MAX_ROW_DEPTH
from llmft.trainer.data.parallel import default_num_proc, ordered_map, worker_pool
from llmft.trainer.data.progress import progress
from llmft.trainer.data.remote import DEFAULT_MAX_FETCH_BYTES, fetch, is_remote, parse_remote
from llmft.trainer.data.sources import (
    CONFIG_ONLY_FOR_HUB,
    RESAVE_AS_UTF8,
    OversizedRow,
    Source,
    TooDeepRow,
    fetched_source,
    open_source,
)
from llmft.trainer.errors import DataError
from llmft.trainer.io import atomic_directory, atomic_write_json, check_output_target

try:  # optional: several times faster; same results and bytes as the json calls below
    import orjson

    _fast_loads, _fast_dumps = orjson.loads, orjson.dumps
except ImportError:  # pragma: no cover - orjson is not a dependency
    _fast_loads = _fast_dumps = None  # type: ignore[assignment]

SPLIT_FILES = {"train": "train.jsonl", "val": "val.jsonl"}
REJECTS_FILE = "rejects.jsonl"
REPORT_FILE = "report.json"
MAX_LISTED_REJECTS = 5
CHUNK_ROWS = 256
PARALLEL_MIN_BYTES = 8 << 20  # smaller inputs convert faster inline than through a pool
PREPARED_KIND = "prepared-dataset"
FETCH_DIR = ".fetched"
"""Where a remote source is downloaded inside the folder being built (removed before it is renamed into place)."""
_RAW_SNIPPET = 200


def prepare_dataset(
    source: str,
    output_dir: str | os.PathLike,
    *,
    format: str = "auto",  # noqa: A002 - mirrors the --format flag
    split: str = "train",
    hub_config: str = "",
    columns: str = "",
    val_fraction: float = 0.05,
    seed: int = 0,
    max_reject_fraction: float = DEFAULT_MAX_REJECT_FRACTION,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    max_fetch_bytes: int = DEFAULT_MAX_FETCH_BYTES,
    allow_http: bool = False,
    force: bool = False,
) -> dict:
    """Validate and convert ``source`` into ``output_dir``; return the report (also report.json).

    ``hub_config`` names a hub dataset's configuration; ``columns`` maps the rows' columns to a format's fields
    (llmft/trainer/data/columns.py). An ``https://`` or ``s3://`` source is fetched into the output being built
    first (llmft/trainer/data/remote.py; at most ``max_fetch_bytes``; plain http only with ``allow_http``).

    Raises DataError (nothing written) when no row is valid or the rejected
    fraction exceeds ``max_reject_fraction``; OutputNotOursError when ``output_dir``
    holds something llmft did not write (unless ``force``) or would replace the input.
    """
    _check_arguments(format, val_fraction, max_reject_fraction, max_row_bytes)
    mapping = parse_columns(columns)
    row_format = mapped_format(mapping, format)
    remote = parse_remote(str(source), allow_http=allow_http) if is_remote(str(source)) else None
    if remote is not None and hub_config:
        raise DataError(f"{remote.label}: {CONFIG_ONLY_FOR_HUB}")
    local = remote is None and Path(source).expanduser().exists()
    inputs = (source,) if local else ()  # a hub id or a URL is no local input
    check_output_target(output_dir, kind=PREPARED_KIND, force=force, inputs=inputs)
    if remote is None:
        src = open_source(str(source), split, config=hub_config, exclude=Path(output_dir), max_row_bytes=max_row_bytes)
    started = time.perf_counter()
    with atomic_directory(Path(output_dir), kind=PREPARED_KIND, marker=True, force=force, inputs=inputs) as tmp:
        if remote is not None:  # into the folder being built: a failed run leaves nothing behind
            src = fetched_source(
                remote, fetch(remote, tmp / FETCH_DIR, max_bytes=max_fetch_bytes), max_row_bytes=max_row_bytes
            )
        tally = _Tally()
        with (
            _SplitWriter(tmp, val_fraction, seed) as splits,
            open(tmp / REJECTS_FILE, "w", encoding="utf-8", errors="backslashreplace") as rejects,
        ):
            for file, line, fmt, data, reject, raw, value in _converted_rows(src, row_format, mapping):
                if reject is None:
                    splits.add(data)
                    tally.accept(fmt)
                else:
                    record = tally.reject(file, line, RowReject(*reject), raw, value)
                    rejects.write(json.dumps(record, ensure_ascii=False) + "\n")
        _check_quality(src, tally, max_reject_fraction)
        shutil.rmtree(tmp / FETCH_DIR, ignore_errors=True)  # read and hashed: the prepared rows are what is kept
        report = _report(src, tally, splits.counts, format, split, val_fraction, seed, max_reject_fraction)
        report.update(hub_config=hub_config if src.kind == "hub" else None, columns=dict(mapping) or None)
        report["max_row_bytes"] = max_row_bytes
        report["seconds"] = round(time.perf_counter() - started, 3)
        atomic_write_json(tmp / REPORT_FILE, report)
    return report


def _converted_rows(src: Source, fmt: str, columns: Columns = ()) -> Iterator[tuple]:
    """(file, line, format, canonical bytes, reject, raw, value) per row, in source order.

    Large JSONL inputs are converted by a pool of processes (chunks of raw lines go
    out, canonical bytes come back); other sources and small files run inline."""
    parallel = (
        src.kind != "hub"
        and all(p.suffix.lower() == ".jsonl" for p in src.files)
        and sum(p.stat().st_size for p in src.files) >= PARALLEL_MIN_BYTES
    )
    num_proc = default_num_proc() if parallel else 1
    with progress(desc="prepare", unit="rows") as bar, worker_pool(num_proc) as pool:  # the bar clears on errors too
        convert = partial(_convert_chunk, fmt, src.max_row_bytes, columns)
        for results in ordered_map(pool, convert, _chunks(src.rows()), 2 * num_proc + 2):
            bar.update(len(results))
            yield from results


def _chunks(rows: Iterator[tuple], size: int = CHUNK_ROWS) -> Iterator[list[tuple]]:
    chunk = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _convert_chunk(fmt: str, max_row_bytes: int, columns: Columns, rows: list[tuple]) -> list[tuple]:
    """Validate and convert one chunk (runs in a worker for large inputs); ``columns`` renamed first."""
    out: list[tuple] = []
    for file, line, raw, value in rows:
        try:
            if isinstance(value, OversizedRow):
                size, raw, value = value.size, value.head, None
                raise _too_large(f"the line has {size:,} bytes", max_row_bytes)
            if isinstance(value, TooDeepRow) or (raw is None and deeper_than(value, MAX_ROW_DEPTH)):
                where, value = getattr(value, "where", "the row"), None  # never serialised for the snippet
                raise RowReject(
                    "too_deep", "<row>", f"{where} nests lists or objects deeper than {MAX_ROW_DEPTH} levels"
                )
            if raw is None and _text_chars(value, max_row_bytes) > max_row_bytes:
                raise _too_large(f"the row holds more than {max_row_bytes:,} characters of text", max_row_bytes)
            decoded = _parse_json(raw) if raw is not None else value
            try:
                row_format, row = convert_row(apply_columns(decoded, columns), fmt)
            except RowReject as reject:
                raise name_columns(reject, columns) from None
            out.append((file, line, row_format, canonical_line(row), None, None, None))
        except RowReject as reject:
            out.append((file, line, None, None, (reject.reason, reject.field, reject.detail), raw, value))
    return out


def _too_large(what: str, max_row_bytes: int) -> RowReject:
    return RowReject("row_too_large", "<row>", f"{what}, above --max-row-bytes {max_row_bytes:,}")


def _text_chars(value: Any, limit: int) -> int:
    """Characters of text in a decoded row (strings, keys included), counting stops past ``limit``."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def _check_arguments(fmt: str, val_fraction: float, max_reject_fraction: float, max_row_bytes: int) -> None:
    if fmt not in FORMAT_CHOICES:
        raise DataError(f"--format {fmt!r} is not a known format; choose one of {', '.join(FORMAT_CHOICES)}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction} must be in [0, 1): some rows must stay in train")
    if not 0.0 <= max_reject_fraction <= 1.0:
        raise DataError(f"--max-reject-fraction {max_reject_fraction} must be in [0, 1]")
    if max_row_bytes < 1024:
        raise DataError(f"--max-row-bytes {max_row_bytes} must be at least 1024")


def canonical_line(row: dict) -> bytes:
    """Compact UTF-8 JSON of a canonical row (identical bytes with or without orjson)."""
    if _fast_dumps is not None:
        try:
            return _fast_dumps(row)
        except TypeError:  # orjson refuses lone surrogates; json decides below
            pass
    try:
        return json.dumps(row, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        raise RowReject("invalid_json", "<line>", "text holds an unpaired UTF-16 surrogate (\\ud800-\\udfff)") from None


def _parse_json(raw: bytes) -> Any:
    value = _loads(raw)
    if may_repeat_a_key(raw, value):  # rare: parse again, slowly, to find the key written twice
        json.loads(raw, object_pairs_hook=refuse_duplicate_keys)
    return value


def _loads(raw: bytes) -> Any:
    if _fast_loads is not None:
        try:
            return _fast_loads(raw)
        except ValueError:
            pass  # orjson is stricter (NaN, huge ints): let json decide
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise RowReject(
            "not_utf8", "<line>", f"byte 0x{raw[exc.start]:02x} at offset {exc.start} is not UTF-8"
        ) from None
    except ValueError as exc:
        raise RowReject("invalid_json", "<line>", f"invalid JSON: {exc}") from None
    except RecursionError:  # orjson stops at 1,024 levels, json at Python's recursion limit (~1,000)
        raise RowReject("too_deep", "<line>", "JSON nested deeper than the parser's limit (~1,000 levels)") from None


class _Tally:
    """Counts of accepted/rejected rows, reasons, formats, and the first rejects for error messages."""

    def __init__(self) -> None:
        self.accepted = 0
        self.rejected = 0
        self.reasons: Counter[str] = Counter()
        self.formats: Counter[str] = Counter()
        self.first_rejects: list[dict] = []
        self.first_by_reason: dict[str, dict] = {}

    @property
    def total(self) -> int:
        return self.accepted + self.rejected

    def accept(self, fmt: str) -> None:
        self.accepted += 1
        self.formats[fmt] += 1

    def reject(self, file: str, line: int, reject: RowReject, raw: bytes | None, value: Any) -> dict:
        self.rejected += 1
        self.reasons[reject.reason] += 1
        record = {
            "file": file,
            "line": line,
            "reason": reject.reason,
            "field": reject.field,
            "message": reject.detail,
            "fix": reject.fix,
            "raw": _snippet(raw, value),
        }
        if len(self.first_rejects) < MAX_LISTED_REJECTS:
            self.first_rejects.append(record)
        self.first_by_reason.setdefault(reject.reason, record)
        return record


def _snippet(raw: bytes | None, value: Any) -> str:
    text = (
        raw.decode("utf-8", "replace").strip()
        if raw is not None
        else json.dumps(value, default=str, ensure_ascii=False)
    )
    return text if len(text) <= _RAW_SNIPPET else text[:_RAW_SNIPPET] + "..."


class _SplitWriter:
    """Streams canonical rows into train.jsonl / val.jsonl by a salted per-row hash."""

    def __init__(self, directory: Path, val_fraction: float, seed: int):
        self.paths = {name: directory / fname for name, fname in SPLIT_FILES.items()}
        self.files = {name: open(path, "wb") for name, path in self.paths.items()}
        self.val_fraction = val_fraction
        self.threshold = int(val_fraction * 2**64)
        self.salt = f"llmft-split/{seed}/".encode()
        self.counts = {name: 0 for name in SPLIT_FILES}
        self._nearest: tuple[int, int] | None = None  # (hash, train index) of the train row closest to val

    def __enter__(self) -> _SplitWriter:
        return self

    def add(self, line: bytes) -> None:
        digest = hashlib.blake2b(self.salt + line, digest_size=8).digest()
        value = int.from_bytes(digest, "big")
        name = "val" if value < self.threshold else "train"
        if name == "train" and (self._nearest is None or value < self._nearest[0]):
            self._nearest = (value, self.counts["train"])
        self.files[name].write(line + b"\n")
        self.counts[name] += 1

    def __exit__(self, *exc_info) -> None:
        for fh in self.files.values():
            fh.close()
        if exc_info[0] is None and self.val_fraction > 0 and self.counts["val"] == 0 and self.counts["train"] >= 2:
            self._move_nearest_to_val()

    def _move_nearest_to_val(self) -> None:
        """Small data can hash no row into val; move the train row whose hash is nearest to it."""
        assert self._nearest is not None
        index = self._nearest[1]
        train, rewritten = self.paths["train"], self.paths["train"].with_suffix(".rewrite")
        with open(train, "rb") as src, open(rewritten, "wb") as dst, open(self.paths["val"], "wb") as val:
            for i, line in enumerate(src):
                (val if i == index else dst).write(line)
        os.replace(rewritten, train)
        self.counts["train"] -= 1
        self.counts["val"] += 1


def _check_quality(src: Source, tally: _Tally, max_reject_fraction: float) -> None:
    if tally.total == 0:
        raise DataError(f"{src.label}: no rows found (empty input); point --input at a file with data")
    fraction = tally.rejected / tally.total
    if (tally.accepted == 0 or fraction > max_reject_fraction) and "not_utf8" in tally.first_by_reason:
        raise DataError(_not_utf8_message(src, tally, max_reject_fraction))
    listing = "\n".join(_describe(r) for r in tally.first_rejects)
    if tally.accepted == 0:
        raise DataError(
            f"{src.label}: no valid row among {tally.total} rows. First offending lines:\n{listing}\n"
            "Fix the rows, or pass --format if auto-detection picked the wrong one."
        )
    if fraction > max_reject_fraction:
        raise DataError(
            f"{src.label}: {tally.rejected} of {tally.total} rows rejected ({fraction:.2%}), above "
            f"--max-reject-fraction {max_reject_fraction:.2%}. First offending lines:\n{listing}\n"
            "Fix these rows, or raise --max-reject-fraction if dropping them is intended."
        )


def _not_utf8_message(src: Source, tally: _Tally, max_reject_fraction: float) -> str:
    """One line for rows that are not UTF-8: the file's encoding is the fault, one fix cures every row."""
    first, count = tally.first_by_reason["not_utf8"], tally.reasons["not_utf8"]
    others = tally.rejected - count
    also = f" (and {others} rejected for other reasons)" if others else ""
    return (
        f"{first['file']}:{first['line']}: not UTF-8 text ({first['message']}); {count} of {tally.total} rows of "
        f"{src.label} are not UTF-8{also}, above --max-reject-fraction {max_reject_fraction:.2%}. Fix: "
        + RESAVE_AS_UTF8.format(encoding="latin1", label=first["file"], stem=Path(first["file"]).with_suffix(""))
    )


def _describe(reject: dict) -> str:
    return (
        f"  {reject['file']}:{reject['line']}: {reject['reason']} in `{reject['field']}`: "
        f"{reject['message']}. Fix: {reject['fix']}"
    )


def _report(
    src: Source,
    tally: _Tally,
    counts: dict,
    fmt: str,
    split: str,
    val_fraction: float,
    seed: int,
    max_reject_fraction: float,
) -> dict:
    detected = fmt if fmt != "auto" else (next(iter(tally.formats)) if len(tally.formats) == 1 else "mixed")
    return {
        "source": src.spec,
        "source_kind": src.kind,
        "source_files": src.file_labels(),
        "source_hash": src.content_hash(),
        "hub_split": split if src.kind == "hub" else None,
        "format_requested": fmt,
        "format": detected,
        "formats": dict(tally.formats.most_common()),
        "total_rows": tally.total,
        "accepted": tally.accepted,
        "rejected": tally.rejected,
        "reject_fraction": round(tally.rejected / tally.total, 6),
        "max_reject_fraction": max_reject_fraction,
        "reject_reasons": dict(tally.reasons.most_common()),
        "splits": dict(counts),
        "val_fraction": val_fraction,
        "seed": seed,
        "files": {**SPLIT_FILES, "rejects": REJECTS_FILE},
    }
