"""Process pools for the data steps: ordered results, bounded read-ahead, fail-fast.

Workers are forked (on Linux) so they inherit what the parent already loaded (a
tokenizer) instead of unpickling it. Results come back in input order, and at
most ``window`` chunks are in flight, so memory stays bounded however large the
input is. A worker that dies (an OOM kill) fails the run at once with a one-line
:class:`~llmft.trainer.errors.TransientError` instead of hanging it.

Workers die with their parent: a parent killed with SIGKILL (or OOM-killed) would
otherwise leave them blocked forever on the task queue, whose write end every
worker inherited. On Linux each worker asks the kernel for SIGKILL when its
parent exits (``prctl(PR_SET_PDEATHSIG)``); elsewhere a thread watches the
parent's pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from llmft.trainer.errors import TransientError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def default_num_proc() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


@contextlib.contextmanager
def worker_pool(num_proc: int, initializer: Callable | None = None, initargs: tuple = ()) -> Iterator:
    """A ProcessPoolExecutor of ``num_proc`` workers, or None (work runs inline) for one.

    Ctrl-C and SIGTERM are held while the workers are forked and while the pool stops, then delivered:
    a signal raised inside the executor's own bookkeeping could lose track of a worker or leave it
    half-built (issue 27.3); a second one while held kills at once."""
    if num_proc <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield None
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # each worker is one core already
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with signals_held():
        pool = ProcessPoolExecutor(
            num_proc, mp_context=ctx, initializer=_init_worker, initargs=(os.getpid(), initializer, initargs)
        )
        pool.submit(os.getpid)  # forks every worker now (a fork-context pool starts them all on its first task)
    try:
        yield pool
    except BaseException:  # an error, Ctrl-C or SIGTERM: stop the workers now, not after their chunks
        with signals_held():
            _kill_workers(pool)
            pool.shutdown(wait=True, cancel_futures=True)
        raise
    with signals_held():
        pool.shutdown(wait=True, cancel_futures=True)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """SIGKILL every worker and reap it; then let the pool's manager thread see the end of the results.

    A worker killed while it wrote a result leaves half a message in the result pipe, and the manager
    thread would wait forever for the rest (the parent holds a write end of that pipe too): the
    `llmft data prepare` hang of issue 27.3. Closing the parent's write end turns the wait into EOF;
    the manager then tears the pool down as broken (CPython concurrent/futures/process.py,
    wait_result_broken_or_wakeup and terminate_broken, which also unblocks the task feeder: gh-94777)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.kill()  # not SIGTERM: a worker still starting has the parent's Python handlers
    for process in processes:
        process.join(timeout=10)
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None:
        writer.close()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM (main thread, Python handlers only) for the block, then deliver them to the
    handlers that were in place; a second one of the same signal while held is delivered at once with
    the default action (the process dies), so a stuck block can always be stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    previous = {signum: handler for signum, handler in previous.items() if handler is not None}
    held: list[int] = []

    def hold(signum, _frame):
        if signum in held:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        held.append(signum)

    for signum in previous:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for held_signal in dict.fromkeys(held):
            signal.raise_signal(held_signal)


def _init_worker(parent: int, initializer: Callable | None, initargs: tuple) -> None:
    """Runs first in every worker: die with the parent; leave Ctrl-C to the parent, which stops the pool
    (a worker's own KeyboardInterrupt would print a traceback); die quietly on SIGTERM (a forked worker
    inherits the parent's Python handlers); then the caller's initializer."""
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if initializer is not None:
        initializer(*initargs)


def die_with_parent(parent: int) -> None:
    """Make this process exit when ``parent`` does (PR_SET_PDEATHSIG on Linux, else a watchdog thread)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before the request took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="llmft-parent-watch").start()


def _watch_parent(parent: int, interval: float = 1.0) -> None:
    while os.getppid() == parent:
        time.sleep(interval)
    os._exit(1)


def ordered_map(pool, fn: Callable, tasks: Iterable, window: int) -> Iterator:
    """``map(fn, tasks)`` on the pool (inline when None), in order, ``window`` tasks ahead at most."""
    if pool is None:
        yield from map(fn, tasks)
        return
    pending: deque = deque()
    try:
        for task in tasks:
            pending.append(pool.submit(fn, task))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as exc:
        raise TransientError(
            "a worker process died (killed by the OS, most likely out of memory); nothing was written. "
            "Fix: lower --num-proc, or give the step more memory, and re-run"
        ) from exc
