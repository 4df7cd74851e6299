"""How many threads a CPU decodes with: the one rule of the evaluate step's held-out answers and the deploy step's
local generation check (llmft/components/lib/evaluation/generations.py, llmft/components/lib/serving/local_check.py).

A greedy decoding step is one token: a few hundred tiny operations, each an OpenMP parallel region whose threads
meet at a barrier. On a shared CPU every region then waits for whichever of its threads the scheduler took away,
so decoding slows down much more beside other busy processes than a training step (large products) does; with one
thread nothing waits. Measured with ``llmft bench eval-threads`` (llmft/benchmarks/eval_threads.py; BENCHMARKS.md,
"Evaluate threads"). Forwards over whole rows (perplexity, training) keep every thread. On a GPU nothing changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

CPU_DECODE_THREADS = 1
"""torch's intra-op threads while a CPU decodes greedily. A decoding step is one token: a few hundred tiny operations,
each an OpenMP parallel region whose threads meet at a barrier, so on a shared CPU every region waits for a
descheduled thread; one thread never waits. Measured with ``llmft bench eval-threads`` (BENCHMARKS.md, "Evaluate
threads"): decoding slowed far more beside busy processes than a training step did with 2 threads, and ran
fastest with 1. Perplexity forwards (large products) keep every thread."""


@contextlib.contextmanager
def decode_threads(device) -> Iterator[None]:
    """On a CPU, decode with at most :data:`CPU_DECODE_THREADS` intra-op threads; the setting is restored after."""
    import torch  # heavy: torch

    before = torch.get_num_threads()
    if getattr(device, "type", str(device)) != "cpu" or before <= CPU_DECODE_THREADS:
        yield
        return
    torch.set_num_threads(CPU_DECODE_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)
