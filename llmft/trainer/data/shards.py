"""On-disk format of a tokenized split, shared by ``llmft data tokenize`` (writer)
and the trainer / evaluator (readers on every rank).

A tokenized dataset directory holds ``manifest.json`` and one folder per split
(``train/``, ``val/``), each with four memory-mappable NumPy arrays:

- ``input_ids.npy``   int32 [T]   every token of every document, in packed order
- ``labels.npy``      int32 [T]   next-token targets are NOT shifted here: ``labels[i]``
                                  is ``input_ids[i]`` when token i is supervised, else -100
- ``doc_offsets.npy`` int64 [D+1] document d is tokens ``doc_offsets[d]:doc_offsets[d+1]``
- ``seq_offsets.npy`` int64 [S+1] training sequence s is documents ``seq_offsets[s]:seq_offsets[s+1]``

Unpacked data has one document per sequence. Packed data groups several
documents per sequence (at most ``max_length`` tokens); position ids restart at
0 for every document, so attention and loss never cross a document boundary.
Arrays are opened with ``mmap_mode="r"``: every rank of a job maps the same
files and reads only its own sequences.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmft.trainer.errors import DataError

ARRAYS = ("input_ids", "labels", "doc_offsets", "seq_offsets")
IGNORE_INDEX = -100
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Sequence:
    """One training row: concatenated documents plus their per-document positions."""

    input_ids: np.ndarray  # int32 [L]
    labels: np.ndarray  # int32 [L], IGNORE_INDEX where not supervised (unshifted)
    position_ids: np.ndarray  # int32 [L], restarts at 0 per document
    doc_lengths: np.ndarray  # int64 [n_docs], sums to L


class TokenizedSplit:
    """Read-only, memory-mapped view of one split of a tokenized dataset."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        missing = [a for a in ARRAYS if not (self.directory / f"{a}.npy").is_file()]
        if missing:
            raise FileNotFoundError(
                f"{self.directory}: not a tokenized split (missing {', '.join(m + '.npy' for m in missing)}); "
                "create it with `llmft data tokenize`"
            )
        arrays = {a: load_array(self.directory / f"{a}.npy") for a in ARRAYS}
        self.input_ids = arrays["input_ids"]
        self.labels = arrays["labels"]
        self.doc_offsets = arrays["doc_offsets"]
        self.seq_offsets = arrays["seq_offsets"]

    def __len__(self) -> int:
        return len(self.seq_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.doc_offsets[-1])

    def sequence_lengths(self, indices) -> np.ndarray:
        """Token counts of sequences ``indices`` (int64), read from the offsets alone."""
        indices = np.asarray(indices, dtype=np.int64)
        return self.doc_offsets[self.seq_offsets[indices + 1]] - self.doc_offsets[self.seq_offsets[indices]]

    def __getitem__(self, index: int) -> Sequence:
        if not 0 <= index < len(self):
            raise IndexError(index)
        d0, d1 = int(self.seq_offsets[index]), int(self.seq_offsets[index + 1])
        offsets = np.asarray(self.doc_offsets[d0 : d1 + 1], dtype=np.int64)
        start, end = int(offsets[0]), int(offsets[-1])
        doc_lengths = np.diff(offsets)
        position_ids = position_ids_for(doc_lengths)
        return Sequence(
            input_ids=np.asarray(self.input_ids[start:end], dtype=np.int32),
            labels=np.asarray(self.labels[start:end], dtype=np.int32),
            position_ids=position_ids,
            doc_lengths=doc_lengths,
        )


def load_array(path: Path) -> np.ndarray:
    """One array of a split, memory-mapped; a file that is not a 1-D integer array (truncated, a pickled
    object array, another dtype) is a one-line DataError naming it. Nothing is unpickled."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, UnicodeDecodeError) as exc:  # numpy's header and size checks
        raise _bad_shard(path, " ".join(str(exc).split())) from None
    if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype.kind not in "iu":
        what = f"{array.dtype} array of shape {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
        raise _bad_shard(path, f"holds a {what}, not a 1-D integer array")
    return array


def _bad_shard(path: Path, why: str) -> DataError:
    return DataError(
        f"{path}: not a readable tokenized array ({why}); the file is truncated, corrupt or was not written by "
        "`llmft data tokenize`. Re-run `llmft data tokenize` into a new --output"
    )


def position_ids_for(doc_lengths: np.ndarray) -> np.ndarray:
    """Positions 0..len-1 for each document, concatenated."""
    total = int(np.sum(doc_lengths))
    if total == 0:
        return np.zeros(0, dtype=np.int32)
    starts = np.repeat(np.cumsum(doc_lengths) - doc_lengths, doc_lengths)
    return (np.arange(total, dtype=np.int64) - starts).astype(np.int32)


def write_split(directory: str | Path, input_ids, labels, doc_offsets, seq_offsets) -> None:
    """Write the four arrays of a split into ``directory`` (caller makes it atomic)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, arr, dtype in (
        ("input_ids", input_ids, np.int32),
        ("labels", labels, np.int32),
        ("doc_offsets", doc_offsets, np.int64),
        ("seq_offsets", seq_offsets, np.int64),
    ):
        np.save(directory / f"{name}.npy", np.asarray(arr, dtype=dtype))


def read_manifest(dataset_dir: str | Path) -> dict:
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; `{dataset_dir}` is not a tokenized dataset (run `llmft data tokenize`)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # truncated, overwritten or not ours
        manifest = exc
    if not isinstance(manifest, dict):
        why = (
            " ".join(str(manifest).split())[:120] if isinstance(manifest, Exception) else f"a {type(manifest).__name__}"
        )
        raise DataError(
            f"{path}: not the JSON `llmft data tokenize` writes ({why}); the folder is damaged. Re-run "
            "`llmft data tokenize` into a new --output"
        )
    return manifest


def open_split(dataset_dir: str | Path, split: str) -> TokenizedSplit:
    return TokenizedSplit(Path(dataset_dir) / split)
