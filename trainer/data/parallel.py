"""Process pools for the data steps: ordered results, bounded read-ahead, fail-fast.

Workers are forked (on Linux) so they inherit what the parent already loaded (a
tokenizer) instead of unpickling it. Results come back in input order, and at
most ``window`` chunks are in flight, so memory stays bounded however large the
input is. A worker that dies (an OOM kill) raises ``BrokenProcessPool`` instead
of hanging the run.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor


def default_num_proc() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


@contextlib.contextmanager
def worker_pool(num_proc: int, initializer: Callable | None = None, initargs: tuple = ()) -> Iterator:
    """A ProcessPoolExecutor of ``num_proc`` workers, or None (work runs inline) for one."""
    if num_proc <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield None
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # each worker is one core already
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pool = ProcessPoolExecutor(num_proc, mp_context=ctx, initializer=initializer, initargs=initargs)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def ordered_map(pool, fn: Callable, tasks: Iterable, window: int) -> Iterator:
    """``map(fn, tasks)`` on the pool (inline when None), in order, ``window`` tasks ahead at most."""
    if pool is None:
        yield from map(fn, tasks)
        return
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.submit(fn, task))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()
