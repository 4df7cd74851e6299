"""Where ``llmft data prepare`` reads rows from, one row at a time.

A source is a local ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file, a
folder of such files, such a file at an ``https://`` URL or ``s3://`` object(s) (fetched first:
llmft/trainer/data/remote.py, :func:`fetched_source`), a Hugging Face hub dataset id (loaded with
``datasets.load_dataset``, a configuration name and split, streaming unless offline mode is on, with
``HF_TOKEN`` from the environment), or ``langfuse://<dataset name>``: the items of a
Langfuse dataset (curated production traces), each item's ``input`` and
``expected_output`` turned into a messages row (llmft/trainer/langfuse_sink.py ``item_row``),
with the LANGFUSE_* keys from the environment. Every reader streams: JSONL line by line,
CSV record by record, Parquet batch by batch, hub datasets row by row. The one
exception is a ``.json`` file holding a single JSON array, which JSON itself
forces us to parse whole; use JSONL for large data.

Each row comes out as ``(file, line, raw, value)``: ``raw`` is the undecoded
bytes of a JSONL line (the caller parses it, so invalid JSON becomes a reject,
not a crash), ``value`` an already-decoded row otherwise. ``line`` is the
1-based line of the file (JSONL, CSV) or the 1-based row number (JSON array,
Parquet, hub).

Rows are bounded: a JSONL line longer than ``max_row_bytes`` is never held in memory; it comes
out as an :class:`OversizedRow` (its size and first bytes) that prepare rejects as
``row_too_large``. A file that cannot be read as its format (a corrupt Parquet file, a CSV that
is not UTF-8, a CSV field above the limit) raises a one-line :class:`DataError` naming the file
(and line where there is one).

Text is UTF-8 (JSON Lines is UTF-8 by definition, RFC 8259 section 8.1): a JSONL file that starts with a
UTF-16 or UTF-32 byte order mark, or whose first row is not UTF-8 (binary data, Latin-1, UTF-16 without a
mark), is one DataError line naming the file, the line and the fix (``iconv``); a later non-UTF-8 line is
prepare's ``not_utf8`` reject. A decoded row (a CSV cell holding JSON, a hub or Langfuse row) nested more
than ``MAX_ROW_DEPTH`` levels comes out as a :class:`TooDeepRow`, rejected as ``too_deep`` and never
serialised (``json.dumps`` would hit Python's recursion limit).

No link is followed: a data file (given, or found in a folder) that is a symlink, FIFO or device is
refused with one line (llmft/trainer/safe_files.py), so ``rejects.jsonl`` can never quote what a link points
to; a linked folder inside an input folder is not entered (a warning names it).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from llmft.trainer.data.formats import RowReject, deeper_than, may_repeat_a_key, refuse_duplicate_keys
from llmft.trainer.data.limits import DEFAULT_MAX_ROW_BYTES, MAX_ROW_DEPTH
from llmft.trainer.data.remote import DATA_SUFFIXES, Fetched, RemoteSpec, is_remote, shown_url
from llmft.trainer.errors import DataError, TransientError
from llmft.trainer.hf_files import hub_fault_message, hub_unreachable, quiet_hub_retries
from llmft.trainer.io import owner_kind, sha256_file
from llmft.trainer.langfuse_sink import dataset_rows
from llmft.trainer.safe_files import check_file, open_file, read_text

SUFFIXES = DATA_SUFFIXES
# Suffixes that name a local file, never a hub dataset (`nope.txt` is a missing file, not a hub id)
FILE_SUFFIXES = (*SUFFIXES, ".txt", ".tsv", ".xlsx", ".xls", ".arrow", ".gz", ".zip", ".bz2", ".xz", ".zst", ".yaml")
_HEAD_BYTES = 200
_TEXT_CHECK_BYTES = 1 << 16  # the first row's bytes checked for UTF-8 (a binary file may have no newline)
_READ_BLOCK = 1 << 20
LANGFUSE_SCHEME = "langfuse://"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# CSV cells that usually hold JSON-encoded lists
_JSON_CELLS = ("messages", "conversations", "prompt", "completion")
log = logging.getLogger(__name__)

Row = tuple[str, int, "bytes | None", Any]


class OversizedRow(NamedTuple):
    """Stands in for a JSONL line above the size limit: its size and first bytes, not the line."""

    size: int
    head: bytes


class TooDeepRow(NamedTuple):
    """Stands in for a decoded row nested deeper than MAX_ROW_DEPTH: where the nesting was found, not the row."""

    where: str


class Source:
    """Rows of one input plus a content hash, computed while the rows stream by."""

    def __init__(
        self,
        spec: str,
        *,
        kind: str,
        files: list[Path] | None = None,
        root: Path | None = None,
        split: str = "train",
        config: str = "",
        labels: dict[Path, str] | None = None,
        max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    ):
        self.spec = spec  # what is shown: a remote source's URL without credentials or signed query
        self.max_row_bytes = max_row_bytes
        self.kind = kind  # "file" | "folder" | "hub" | "langfuse" | "https" | "http" | "s3"
        self.files = files or []
        self.root = root
        self.split = split
        self.config = config  # a hub dataset's configuration (subset) name; '' = its default
        self.labels = labels or {}  # a fetched file -> the URL its rows are reported under
        self._file_hashes: dict[str, str] = {}
        self._hub_hash = hashlib.sha256()

    @property
    def label(self) -> str:
        if self.kind != "hub":
            return self.spec
        return f"{self.spec} ({f'config {self.config}, ' if self.config else ''}split {self.split})"

    def file_labels(self) -> list[str]:
        return [self._label(p) for p in self.files] if self.files else [self.label]

    def _label(self, path: Path) -> str:
        if path in self.labels:
            return self.labels[path]
        if self.kind == "folder" and self.root is not None:
            return str(path.relative_to(self.root))
        return str(path)

    def rows(self) -> Iterator[Row]:
        if self.kind == "hub":
            yield from self._hub_rows()
            return
        if self.kind == "langfuse":
            yield from self._langfuse_rows()
            return
        for path in self.files:
            yield from self._file_rows(path, self._label(path))

    def content_hash(self) -> str:
        """SHA-256 of the source: the file's bytes for one file; of (name, file hash) pairs for a
        folder; of the rows' JSON for a hub or Langfuse dataset. Valid once ``rows()`` is exhausted."""
        if self.kind in ("hub", "langfuse"):
            return self._hub_hash.hexdigest()
        if self.kind != "folder" and len(self._file_hashes) == 1:  # one file, local or fetched: its bytes
            return next(iter(self._file_hashes.values()))
        h = hashlib.sha256()
        for name in sorted(self._file_hashes):
            h.update(f"{name}\0{self._file_hashes[name]}\n".encode())
        return h.hexdigest()

    def _file_rows(self, path: Path, label: str) -> Iterator[Row]:
        suffix = path.suffix.lower()
        if suffix == ".jsonl" or (suffix == ".json" and not _starts_with_array(path)):
            yield from self._jsonl_rows(path, label)
            return
        self._file_hashes[label] = sha256_file(path)
        if suffix == ".json":
            yield from _json_array_rows(path, label)
        elif suffix == ".csv":
            yield from _csv_rows(path, label, self.max_row_bytes)
        else:
            yield from _parquet_rows(path, label)

    def _jsonl_rows(self, path: Path, label: str) -> Iterator[Row]:
        h = hashlib.sha256()
        limit = self.max_row_bytes
        with open_file(path, path.parent) as fh:
            number, text_checked = 0, False
            while line := fh.readline(limit + 2):  # room for the line's own "\r\n"
                number += 1
                h.update(line)
                if number == 1:
                    _refuse_utf16_or_32(line, label)
                if not text_checked and line.strip():  # the first row tells a binary or non-UTF-8 file: one line
                    _refuse_not_utf8(line[:_TEXT_CHECK_BYTES], label, number)
                    text_checked = True
                if len(line) > limit and len(line.rstrip(b"\r\n")) > limit:
                    size = _skip_rest_of_line(fh, line, h)
                    yield label, number, None, OversizedRow(size, line[:_HEAD_BYTES])
                elif line.strip():
                    yield label, number, line, None
        self._file_hashes[label] = h.hexdigest()

    def _hub_rows(self) -> Iterator[Row]:
        dataset = load_hub_dataset(self.spec, self.split, self.config)
        for number, row in enumerate(dataset, 1):
            yield self.label, number, None, self._hashed(number, row)

    def _langfuse_rows(self) -> Iterator[Row]:
        """Row number = the item's position in the dataset; the item id is in the hash."""

        for number, (item_id, row) in enumerate(dataset_rows(self.spec[len(LANGFUSE_SCHEME) :]), 1):
            yield self.label, number, None, self._hashed(number, row, item_id)

    def _hashed(self, number: int, row: Any, *item_id: str) -> Any:
        """Add a decoded row to the source hash; a row nested too deep to serialise (Python's recursion limit)
        is hashed by its number and comes out as a TooDeepRow, which prepare rejects as too_deep."""
        if deeper_than(row, MAX_ROW_DEPTH):
            self._hub_hash.update(f"too-deep row {number} {item_id}".encode())
            return TooDeepRow("the row")
        self._hub_hash.update(json.dumps([*item_id, row] if item_id else row, sort_keys=True, default=str).encode())
        return row


def fetched_source(remote: RemoteSpec, fetched: list[Fetched], *, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Source:
    """The rows of files fetched from ``remote`` (llmft/trainer/data/remote.py), reported under their URLs."""
    files = [f.path for f in fetched]
    labels = {f.path: f.label for f in fetched}
    return Source(remote.label, kind=remote.scheme, files=files, labels=labels, max_row_bytes=max_row_bytes)


def open_source(
    spec: str,
    split: str = "train",
    *,
    config: str = "",
    exclude: Path | None = None,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
) -> Source:
    """Resolve ``spec`` to a local file, a local folder or a hub dataset id (``config``: its configuration name).
    Files under ``exclude`` (the output directory, when it sits inside the input folder) are skipped. A remote
    source is fetched first (:func:`fetched_source`)."""
    if config and (spec.startswith(LANGFUSE_SCHEME) or is_remote(spec)):
        raise DataError(f"{shown_url(spec) if is_remote(spec) else spec}: {CONFIG_ONLY_FOR_HUB}")
    if spec.startswith(LANGFUSE_SCHEME):
        if not spec[len(LANGFUSE_SCHEME) :].strip():
            raise DataError(f"{spec}: name the Langfuse dataset: langfuse://<dataset name>")
        return Source(spec, kind="langfuse", split=split, max_row_bytes=max_row_bytes)
    path = Path(spec).expanduser()
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        check_file(path, path.parent)  # a link, FIFO or device is refused (llmft/trainer/safe_files.py)
    if (path.is_file() or path.is_dir()) and config:
        raise DataError(f"{spec}: {CONFIG_ONLY_FOR_HUB}")
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise DataError(f"{spec}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
        return Source(spec, kind="file", files=[path], split=split, max_row_bytes=max_row_bytes)
    if path.is_dir():
        files = folder_files(path, exclude)
        if not files:
            raise DataError(f"{spec}: folder holds no {'/'.join(SUFFIXES)} files; point --input at the data files")
        return Source(spec, kind="folder", files=files, root=path, split=split, max_row_bytes=max_row_bytes)
    if _looks_local(spec, path):
        raise DataError(
            f"{spec}: no such file or folder (and not a hub dataset id like `tatsu-lab/alpaca`); "
            f"local data must be a {'/'.join(SUFFIXES)} file or a folder of them, or https://... or s3://..."
        )
    return Source(spec, kind="hub", split=split, config=config, max_row_bytes=max_row_bytes)


CONFIG_ONLY_FOR_HUB = "a configuration name (--hub-config, the pipeline's dataset_config) applies to a hub dataset only"


def folder_files(folder: Path, exclude: Path | None = None) -> list[Path]:
    """The data files of ``folder`` (hidden names and ``exclude`` skipped), walked without following
    links: a linked or special file with a data suffix is refused (llmft/trainer/safe_files.py), a linked
    folder is not entered (a warning names it). A folder inside it that llmft wrote (it carries the
    owner marker, llmft/trainer/io.py: an earlier prepare's --output, tokenized data, a run) is not entered
    either (a warning names it): its train/val rows would be read back as new input."""
    skip = exclude.resolve() if exclude is not None else None
    files = []
    for root, dirs, names in os.walk(folder):  # followlinks=False
        here = Path(root)
        if skip is not None and here.resolve().is_relative_to(skip):
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in [d for d in dirs if os.path.islink(here / d)]:
            log.warning("%s: a symlink to a folder; not followed, its files are not read", here / name)
        dirs[:] = [d for d in dirs if not os.path.islink(here / d)]
        for name in [d for d in dirs if owner_kind(here / d)]:
            log.warning(
                "%s: written by llmft (%s); not read as input, so an earlier output inside the input folder is never "
                "read back",
                here / name,
                owner_kind(here / name),
            )
        dirs[:] = [d for d in dirs if not owner_kind(here / d)]
        for name in names:
            if not name.startswith(".") and Path(name).suffix.lower() in SUFFIXES:
                check_file(here / name, folder)
                files.append(here / name)
    return sorted(files)


def _looks_local(spec: str, path: Path) -> bool:
    """A spec that can only mean a local path: a file suffix, a path prefix, a dotted name without an
    owner (`nope.txt`; hub ids without an owner, like `imdb`, have no dot), or not a hub id at all."""
    return (
        path.suffix.lower() in FILE_SUFFIXES
        or spec.startswith((".", "/", "~"))
        or ("/" not in spec and "." in spec)
        or not _HUB_ID.match(spec)
    )


def load_hub_dataset(dataset_id: str, split: str, config: str = ""):
    """``datasets.load_dataset`` for a hub id (``config``: its configuration name, '' = the default one): streaming
    online, from the local cache offline.

    HF_TOKEN (from a Kubernetes Secret in the pipeline) authenticates gated and private
    datasets; HF_HUB_OFFLINE / HF_DATASETS_OFFLINE make ``datasets`` read only its cache.
    """
    # heavy: datasets
    import datasets

    offline = bool(datasets.config.HF_HUB_OFFLINE) or os.environ.get("HF_DATASETS_OFFLINE", "0") in (
        "1",
        "true",
        "TRUE",
    )
    token = os.environ.get("HF_TOKEN") or None
    try:
        with quiet_hub_retries():
            named = (config,) if config else ()  # load_dataset(path, name, ...): the configuration is its 2nd argument
            return datasets.load_dataset(dataset_id, *named, split=split, streaming=not offline, token=token)
    except Exception as exc:  # noqa: BLE001 - any loader failure is a data error for the user
        unreachable = None if offline else hub_unreachable(exc)  # offline, the hub is never asked
        if unreachable:
            raise TransientError(hub_fault_message("--input", dataset_id, unreachable)) from None
        mode = "offline: only the local datasets cache is read" if offline else "online, streaming"
        which = f"configuration {config!r}, split {split!r}" if config else f"split {split!r}"
        raise DataError(
            f"{dataset_id}: cannot load hub dataset {which} ({mode}): {type(exc).__name__}: {exc}. "
            "Fix: check the dataset id, --hub-config and --split; set HF_TOKEN for gated or private datasets; "
            "in offline mode, download the dataset into the cache first (or pass a local file)."
        ) from exc


_WIDE_BOMS = {
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\xfe\xff": "UTF-16",
    b"\xff\xfe": "UTF-16",
}
RESAVE_AS_UTF8 = "re-save it as UTF-8, e.g. `iconv -f {encoding} -t utf-8 {label} > {stem}.utf8.jsonl`"
"""The fix for a file that is not UTF-8 (also prepare's when rows in the middle of a file are not)."""


def _refuse_utf16_or_32(first_line: bytes, label: str) -> None:
    """JSON Lines is UTF-8 (RFC 8259 section 8.1; jsonlines.org): a UTF-16 or UTF-32 file (its byte order
    mark tells) is refused in one line, never split at its 0x0A bytes into broken rows and a phantom one."""
    for bom, encoding in _WIDE_BOMS.items():
        if first_line.startswith(bom):
            fix = RESAVE_AS_UTF8.format(encoding=encoding.lower(), label=label, stem=Path(label).with_suffix(""))
            raise DataError(f"{label}:1: {encoding} text (byte order mark); JSON Lines must be UTF-8: {fix}")


def _refuse_not_utf8(line: bytes, label: str, number: int) -> None:
    """One line for a file whose first row is not UTF-8 text (binary data, Latin-1, UTF-16 without a byte
    order mark): the encoding is the file's, so every row would be rejected alike."""
    nul = line.find(b"\x00")
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data":  # a character cut by the check's byte limit
            return
        what = f"byte 0x{line[exc.start]:02x} at offset {exc.start} of the line is not UTF-8"
    else:
        if nul < 0:
            return
        what = f"a NUL byte at offset {nul} of the line"
    fix = RESAVE_AS_UTF8.format(encoding="latin1", label=label, stem=Path(label).with_suffix(""))
    raise DataError(
        f"{label}:{number}: not UTF-8 text ({what}): a binary file, or text in another encoding (Latin-1, "
        f"Windows-1252, UTF-16). Give JSON Lines saved as UTF-8: {fix}"
    )


def _starts_with_array(path: Path) -> bool:
    with open_file(path, path.parent) as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _json_array_rows(path: Path, label: str) -> Iterator[Row]:
    try:
        text = read_text(path, path.parent, encoding="utf-8-sig")
        rows = json.loads(text)
        if may_repeat_a_key(text.encode(), rows):  # a .json array is parsed whole: one line for the file
            json.loads(text, object_pairs_hook=refuse_duplicate_keys)
    except RowReject as exc:
        raise DataError(
            f"{label}: {exc.detail}; {exc.fix}. Or write the rows as JSON Lines (.jsonl), where that row alone "
            "is rejected (duplicate_key) with its line"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{label}: not valid JSON ({exc}); fix the file, or write it as JSON Lines (.jsonl)") from exc
    except RecursionError:
        raise DataError(
            f"{label}: JSON nested deeper than the parser's limit (~1,000 levels); a .json array is parsed whole, so "
            "one such row fails the file: write it as JSON Lines (.jsonl), where that row alone is rejected (too_deep)"
        ) from None
    for number, row in enumerate(rows, 1):
        yield label, number, None, row


def _csv_rows(path: Path, label: str, max_row_bytes: int) -> Iterator[Row]:
    csv.field_size_limit(max(max_row_bytes, 1 << 17))
    with io.TextIOWrapper(open_file(path, path.parent), newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        try:
            for record in reader:
                row = {k: _maybe_json(k, v) for k, v in record.items() if k is not None}
                deep = [v for v in row.values() if isinstance(v, TooDeepRow)]
                yield label, reader.line_num, None, deep[0] if deep else row
        except UnicodeDecodeError as exc:
            line = _first_undecodable_line(path)
            raise DataError(
                f"{label}:{line}: not UTF-8 text ({exc.reason} at byte 0x{exc.object[exc.start]:02x}); "
                "re-save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
            ) from None
        except csv.Error as exc:
            raise DataError(
                f"{label}:{reader.line_num + 1}: unreadable CSV record ({exc}); a field above --max-row-bytes "
                f"{max_row_bytes} or an unclosed quote. Fix the record, or raise --max-row-bytes"
            ) from None


def _first_undecodable_line(path: Path) -> int:
    """1-based number of the first line of ``path`` that is not valid UTF-8."""
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def _maybe_json(key: str, value: Any) -> Any:
    if key in _JSON_CELLS and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        except RecursionError:  # deeper than the parser's limit (~1,000 levels)
            return TooDeepRow(f"column `{key}`")
        return TooDeepRow(f"column `{key}`") if deeper_than(parsed, MAX_ROW_DEPTH) else parsed
    return value


def _parquet_rows(path: Path, label: str) -> Iterator[Row]:
    # heavy: pyarrow
    import pyarrow

    # heavy: pyarrow
    import pyarrow.parquet as pq

    number = 0
    try:
        with open_file(path, path.parent) as fh:
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    number += 1
                    yield label, number, None, row
    except pyarrow.ArrowException as exc:
        where = f"{label}: after row {number}" if number else label
        raise DataError(
            f"{where}: not a readable Parquet file ({type(exc).__name__}: {' '.join(str(exc).split())}); "
            "re-export it, or remove it from the input folder"
        ) from None


def _skip_rest_of_line(fh, head: bytes, h) -> int:
    """Read (and hash) the rest of an oversized line in blocks; return its size without the newline."""
    size = len(head)
    last = head
    while not last.endswith(b"\n"):
        last = fh.readline(_READ_BLOCK)
        if not last:
            break
        h.update(last)
        size += len(last)
    return size - (2 if last.endswith(b"\r\n") else 1 if last.endswith(b"\n") else 0)
