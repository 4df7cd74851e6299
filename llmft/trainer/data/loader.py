"""Deterministic, world-size-independent batches from a tokenized split.

Step ``s`` (1-based) of a run always trains on the same ``global_sequences``
packed sequences, whatever the number of ranks: the epoch's permutation comes
from ``(seed, epoch)``, the step takes the next contiguous block of it, and its
sequences are dealt to the ``W`` ranks in equal counts with the token totals
balanced (:func:`balanced_shares`): a data-parallel step waits for its slowest
rank, so uneven shares of variable-length sequences cost throughput. Each rank
flattens its share (in block order) into micro batches of ``micro_sequences``
sequences concatenated in one row (no padding), with per-document
``position_ids`` and ``cu_seqlens``.

Targets are shifted on the host: ``targets[t]`` is the label of token ``t+1``,
or -100 where token ``t+1`` starts a new document, so the loss never crosses a
document boundary. Every rank also counts the supervised targets of the WHOLE
global batch from the memory-mapped labels, so the loss can be normalised by
that count without a collective or a host sync.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmft.trainer.data.shards import IGNORE_INDEX, TokenizedSplit, open_split, read_manifest
from llmft.trainer.errors import DataError


@dataclass
class MicroBatch:
    """One forward pass: a single flattened row of several packed sequences."""

    input_ids: np.ndarray  # int64 [T]
    position_ids: np.ndarray  # int64 [T], restarts at 0 per document
    targets: np.ndarray  # int64 [T], shifted labels, IGNORE_INDEX at doc ends / unsupervised
    doc_lengths: np.ndarray  # int64 [D]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def to_torch(self, device, pin: bool = False) -> dict:
        """Tensors for the model: [1, T] rows plus cu_seqlens/max_seqlen for varlen kernels, and
        ``supervised``: the flat positions of the supervised targets, found here on the host so
        the fused loss needs no device-to-host sync to find them mid-step."""
        # heavy: torch
        import torch

        def tensor(arr, dtype):
            t = torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
            if pin:
                t = t.pin_memory()
            return t.to(device, non_blocking=True)

        cu = np.zeros(len(self.doc_lengths) + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths, out=cu[1:])
        return {
            "input_ids": tensor(self.input_ids, torch.long).unsqueeze(0),
            "position_ids": tensor(self.position_ids, torch.long).unsqueeze(0),
            "targets": tensor(self.targets, torch.long).unsqueeze(0),
            "cu_seqlens": tensor(cu, torch.int32),
            "supervised": tensor(np.flatnonzero(self.targets != IGNORE_INDEX), torch.long),
            "max_seqlen": int(self.doc_lengths.max()) if len(self.doc_lengths) else 0,
        }


@dataclass
class StepBatch:
    """Everything rank ``rank`` needs for one optimizer step."""

    step: int  # 1-based
    epoch: int
    micro_batches: list[MicroBatch]
    global_targets: int  # supervised targets in the whole global batch (all ranks)
    global_tokens: int  # real tokens in the whole global batch (all ranks)
    global_doc_lengths: np.ndarray  # length of every document of the global batch (model FLOPs)


def build_micro_batch(split: TokenizedSplit, indices) -> MicroBatch:
    """Concatenate sequences ``indices`` of ``split`` into one row with shifted targets."""
    parts = [split[int(i)] for i in indices]
    input_ids = np.concatenate([p.input_ids for p in parts]).astype(np.int64)
    labels = np.concatenate([p.labels for p in parts]).astype(np.int64)
    position_ids = np.concatenate([p.position_ids for p in parts]).astype(np.int64)
    doc_lengths = np.concatenate([p.doc_lengths for p in parts]).astype(np.int64)
    return MicroBatch(input_ids, position_ids, shift_targets(labels, position_ids), doc_lengths)


def shift_targets(labels: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
    """Next-token targets; IGNORE_INDEX where the next token begins another document."""
    targets = np.full(len(labels), IGNORE_INDEX, dtype=np.int64)
    if len(labels) > 1:
        targets[:-1] = labels[1:]
        targets[:-1][position_ids[1:] == 0] = IGNORE_INDEX
    return targets


def count_targets(split: TokenizedSplit, indices) -> tuple[int, int, np.ndarray]:
    """(supervised targets, tokens, every document's length) of sequences ``indices``."""
    targets, lengths = 0, []
    for i in indices:
        d0, d1 = int(split.seq_offsets[i]), int(split.seq_offsets[i + 1])
        offsets = np.asarray(split.doc_offsets[d0 : d1 + 1], dtype=np.int64)
        labels = np.asarray(split.labels[offsets[0] : offsets[-1]])
        supervised = labels != IGNORE_INDEX
        supervised[offsets[:-1] - offsets[0]] = False  # a document's first token is nobody's target
        targets += int(supervised.sum())
        lengths.append(np.diff(offsets))
    doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    return targets, int(doc_lengths.sum()), doc_lengths


def has_supervised_targets(dataset_dir: str | Path, split: str, max_sequences: int = 0) -> bool:
    """True when the first ``max_sequences`` sequences of ``split`` (0 = all) have a supervised target."""
    data = open_split(dataset_dir, split)
    count = len(data) if max_sequences <= 0 else min(len(data), max_sequences)
    return any(count_targets(data, [i])[0] > 0 for i in range(count))


def balanced_shares(lengths, world_size: int) -> list[np.ndarray]:
    """Positions of ``lengths`` dealt to ``world_size`` ranks: equal counts, token totals balanced.

    Longest first, each to the rank with the fewest tokens that still has room (ties: the
    lower rank); every share is returned in the original order. Deterministic, so every rank
    computes the same split. One rank gets everything, in order.
    """
    count = len(lengths)
    if world_size == 1:
        return [np.arange(count)]
    room = count // world_size
    totals = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for pos in sorted(range(count), key=lambda i: (-int(lengths[i]), i)):
        rank = min((r for r in range(world_size) if len(shares[r]) < room), key=lambda r: (totals[r], r))
        shares[rank].append(pos)
        totals[rank] += int(lengths[pos])
    return [np.array(sorted(share), dtype=np.int64) for share in shares]


def resolve_global_sequences(global_sequences: int, global_tokens: int, max_length: int) -> int:
    """Sequences per step: from the token budget when set, else the sequence count."""
    if global_tokens > 0:
        return max(1, round(global_tokens / max_length))
    return global_sequences


class PackedLoader:
    """Per-rank view of the training split, addressed by global step number."""

    def __init__(
        self,
        dataset_dir: str | Path,
        split: str,
        *,
        global_sequences: int,
        micro_sequences: int,
        rank: int,
        world_size: int,
        seed: int,
    ):
        self.split = open_split(dataset_dir, split)
        self.global_sequences = global_sequences
        self.micro_sequences = micro_sequences
        self.rank, self.world_size, self.seed = rank, world_size, seed
        if global_sequences % world_size:
            raise DataError(
                f"batch: {global_sequences} sequences per step cannot be split evenly over {world_size} ranks; "
                f"set batch.global_sequences to a multiple of {world_size}"
            )
        if len(self.split) < global_sequences:
            raise DataError(
                f"{self.split.directory}: {len(self.split)} training sequences, fewer than one global batch of "
                f"{global_sequences}; lower batch.global_sequences (or batch.global_tokens)"
            )
        self.per_rank = global_sequences // world_size
        self.accum_steps = math.ceil(self.per_rank / micro_sequences)
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmft-loader")

    @property
    def steps_per_epoch(self) -> int:
        return len(self.split) // self.global_sequences

    def total_steps(self, max_steps: int, epochs: float) -> int:
        return max_steps if max_steps > 0 else max(1, int(epochs * self.steps_per_epoch))

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.split))
            self._perm_epoch = epoch
        return self._perm

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, steps done in it) once 1-based ``step`` has trained: the epoch is the one that
        step's batch came from (0-based), so step ``steps_per_epoch`` ends epoch 0."""
        if step <= 0:
            return 0, 0
        epoch, pos = divmod(step - 1, self.steps_per_epoch)
        return epoch, pos + 1

    def global_indices(self, step: int) -> tuple[int, np.ndarray]:
        """(epoch, sequence indices) of 1-based ``step`` over all ranks."""
        epoch, done = self.position(step)
        pos = done - 1
        perm = self._permutation(epoch)
        return epoch, perm[pos * self.global_sequences : (pos + 1) * self.global_sequences]

    def batch(self, step: int) -> StepBatch:
        epoch, indices = self.global_indices(step)
        targets, tokens, doc_lengths = count_targets(self.split, indices)
        mine = indices[balanced_shares(self.split.sequence_lengths(indices), self.world_size)[self.rank]]
        micro = [
            build_micro_batch(self.split, mine[i : i + self.micro_sequences])
            for i in range(0, len(mine), self.micro_sequences)
        ]
        return StepBatch(step, epoch, micro, targets, tokens, doc_lengths)

    def iter_steps(self, first_step: int, last_step: int):
        """Yield StepBatch for steps first..last, building the next one in a background thread."""
        if first_step > last_step:
            return
        future = self._pool.submit(self.batch, first_step)
        for step in range(first_step, last_step + 1):
            current = future.result()
            if step < last_step:
                future = self._pool.submit(self.batch, step + 1)
            yield current

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def eval_micro_batches(
    dataset_dir: str | Path,
    split: str,
    *,
    micro_sequences: int,
    rank: int = 0,
    world_size: int = 1,
    max_sequences: int = 0,
):
    """This rank's evaluation micro batches: sequences rank, rank+W, ... in order."""
    data = open_split(dataset_dir, split)
    count = len(data) if max_sequences <= 0 else min(len(data), max_sequences)
    mine = np.arange(rank, count, world_size)
    for i in range(0, len(mine), micro_sequences):
        yield build_micro_batch(data, mine[i : i + micro_sequences])


def dataset_info(dataset_dir: str | Path) -> dict:
    """The tokenized dataset's manifest, with a clear error when it is not one."""
    try:
        manifest = read_manifest(dataset_dir)
    except FileNotFoundError as exc:
        raise DataError(str(exc)) from None
    for key in ("cache_key", "max_length"):
        if key not in manifest:
            raise DataError(
                f"{Path(dataset_dir) / 'manifest.json'}: field `{key}` missing; re-run `llmft data tokenize`"
            )
    return manifest
