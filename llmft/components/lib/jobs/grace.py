"""How long a training pod may take to stop: its ``terminationGracePeriodSeconds``, sized from its checkpoint.

On SIGTERM (preemption, a drain, a cancel's delete) the trainer finishes the step in flight, agrees with the
other ranks to stop, commits a checkpoint and exits 143 (llmft/trainer/steps.py). Kubernetes waits
``terminationGracePeriodSeconds`` (default 30 s) and then sends SIGKILL: a checkpoint that takes longer to
write is lost, and so is the progress since the previous one. The grace is therefore

    STOP_S + checkpoint bytes / CHECKPOINT_WRITE_BYTES_PER_S

where the bytes are the run's checkpoint as the plan step estimates it (llmft/components/lib/plan/
volume_space.py: the trained weights in float32 and AdamW's two moments, 12 bytes per trained parameter; a
LoRA r16 adapter of an 8B model is about 0.5 GB, a full fine-tune of it about 96 GB) and the write rate a
stated, conservative one for the network file systems the data volume lives on (NFS, CephFS, EFS, Filestore,
Lustre; one stream, not a benchmark). When the model's config.json cannot be read at plan time (a hub id not
in the volume's cache yet), :data:`UNKNOWN_GRACE_S`. A longer grace costs nothing when the trainer stops in
time: the pod goes as soon as it exits.
"""

from __future__ import annotations

import math

from llmft.components.lib.contracts.schema import UNKNOWN_GRACE_S

CHECKPOINT_WRITE_BYTES_PER_S = 100 * 2**20
"""The stated write rate of the data volume: 100 MiB/s (a single writer on NFS or a cloud file share)."""
STOP_S = 120
"""The step in flight (a large model's step takes tens of seconds), the ranks' agreement to stop, the exit."""


def grace_period_s(checkpoint_bytes: int | None) -> int:
    """``terminationGracePeriodSeconds`` of a training pod whose checkpoint has ``checkpoint_bytes`` (None:
    unknown)."""
    if checkpoint_bytes is None:
        return UNKNOWN_GRACE_S
    return STOP_S + math.ceil(checkpoint_bytes / CHECKPOINT_WRITE_BYTES_PER_S)
