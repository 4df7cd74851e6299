"""safetensors files written tensor by tensor, so a checkpoint larger than memory can be rewritten.

The format (https://github.com/huggingface/safetensors, README "Format"): 8 bytes little-endian
header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {...}}`` (padded with spaces to a multiple of 8), then the tensors' raw
little-endian bytes, ``data_offsets`` counted from the end of the header, contiguous.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once and copies them
into one buffer; :class:`ShardStream` instead writes each file's header from a plan (names,
dtypes, shapes known in advance from the input headers) and then appends each tensor's bytes as it
arrives: at most one tensor is held.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

INDEX_FILE = "model.safetensors.index.json"
_CODES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
}
DTYPES = {code: dtype for code, dtype in _CODES.items() if dtype is not None}
"""safetensors dtype code -> torch dtype."""
CODES = {dtype: code for code, dtype in DTYPES.items()}


def read_header(path: str | Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file, in the order their bytes are stored."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return dict(sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]))


@dataclass(frozen=True)
class Entry:
    """One tensor of the output: what its header says."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive runs of ``entries`` of at most ``max_bytes`` each (a larger tensor alone)."""
    shards: list[list[Entry]] = []
    size = 0
    for entry in entries:
        if not shards or (shards[-1] and size + entry.nbytes > max_bytes):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """``model.safetensors`` alone, or ``model-0000i-of-0000N.safetensors`` (save_pretrained's names)."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header_bytes(entries: list[Entry]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": CODES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class ShardStream:
    """Write the planned shards into ``directory``; tensors must arrive in plan order."""

    def __init__(self, directory: Path, shards: list[list[Entry]]):
        self.directory, self.shards = Path(directory), shards
        self.names = shard_names(len(shards))
        self.order = [(i, entry) for i, shard in enumerate(shards) for entry in shard]
        self.position = 0
        self.handle: BinaryIO | None = None
        self.open_index = -1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        index, entry = self.order[self.position]
        if name != entry.name or tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise RuntimeError(
                f"{name} {tensor.dtype} {tuple(tensor.shape)} arrived where the plan has {entry.name} "
                f"{entry.dtype} {entry.shape}"
            )
        if index != self.open_index:
            self._open(index)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        assert self.handle is not None  # opened above
        self.handle.write(data.numpy().data)
        self.position += 1

    def _open(self, index: int) -> None:
        if self.handle is not None:
            self.handle.close()
        self.handle = open(self.directory / self.names[index], "wb")  # noqa: SIM115 - closed in _open/close
        self.handle.write(_header_bytes(self.shards[index]))
        self.open_index = index

    def close(self) -> list[str]:
        """Close the last file and write the index (for more than one shard); returns the file names."""
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        if self.position != len(self.order):
            missing = [entry.name for _, entry in self.order[self.position :]]
            raise RuntimeError(f"{len(missing)} planned tensors never arrived (e.g. {missing[:3]})")
        if len(self.shards) > 1:
            weight_map = {entry.name: self.names[i] for i, entry in self.order}
            total = sum(entry.nbytes for _, entry in self.order)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return self.names
