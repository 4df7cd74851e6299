"""Best-fit-decreasing packing of documents into fixed-capacity sequences.

Documents are taken longest first; each goes into the open sequence whose free
space is the smallest that still fits it, or opens a new sequence. Open
sequences are kept in a sorted list keyed by (free space, sequence id), so each
placement is a binary search: 100k documents pack in well under a second.
Documents are never split, so every document keeps its own positions and
boundaries (see :func:`llmft.trainer.data.shards.position_ids_for`).
"""

from __future__ import annotations

import bisect

import numpy as np

_ID_BITS = 40  # sequence ids below 2**40 share one integer key with their free space


def best_fit_pack(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Group document indices into sequences of total length <= ``capacity``.

    Deterministic: ties in length keep document order, ties in free space pick the
    oldest sequence. Returns the sequences in the order they were opened.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.max() > capacity or lengths.min() <= 0):
        raise ValueError(f"document lengths must be in [1, {capacity}]")
    order = np.argsort(-lengths, kind="stable")
    sequences: list[list[int]] = []
    open_keys: list[int] = []  # sorted (free << _ID_BITS) | sequence id
    mask = (1 << _ID_BITS) - 1
    for doc in order.tolist():
        size = int(lengths[doc])
        pos = bisect.bisect_left(open_keys, size << _ID_BITS)
        if pos < len(open_keys):
            key = open_keys.pop(pos)
            free, seq = key >> _ID_BITS, key & mask
        else:
            free, seq = capacity, len(sequences)
            sequences.append([])
        sequences[seq].append(doc)
        free -= size
        if free > 0:
            bisect.insort(open_keys, (free << _ID_BITS) | seq)
    return sequences


def packing_efficiency(total_tokens: int, num_sequences: int, capacity: int) -> float:
    """Real tokens / token slots (``num_sequences * capacity``)."""
    slots = num_sequences * capacity
    return float(total_tokens) / slots if slots else 0.0
