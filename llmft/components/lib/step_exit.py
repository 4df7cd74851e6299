"""How a pipeline step ends when it cannot finish: one ``error:`` line and the exit-code contract.

A KFP lightweight component is a function the KFP executor calls; an exception it does not catch
ends the pod with a traceback and exit 1, whatever it was. :func:`step_outcome` wraps a step's body:

* an :class:`~llmft.trainer.errors.LlmftError` (bad input: 1; a transient fault: 200) prints
  ``error: <message>`` on stderr and exits with its code, no traceback: the task's log in the KFP UI
  (and ``llmft pipeline run-local``) ends with the reason;
* SIGTERM (an evicted pod, a cancelled run, run-local stopped) raises in the main thread like Ctrl-C
  does, so every ``with`` block on the way out runs (a half-copied ``atomic_directory`` is removed,
  not left as a hidden temporary folder for a day), then one line and exit 143;
* anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from llmft.trainer.errors import LlmftError, SignalStop


@contextlib.contextmanager
def step_outcome(step: str) -> Iterator[None]:
    """The body of the pipeline step ``step`` (its task name, for the messages)."""
    previous = _stop_on_sigterm(step)
    try:
        yield
    except SignalStop as stop:
        print(f"error: {stop}", file=sys.stderr, flush=True)
        raise SystemExit(stop.exit_code) from None
    except LlmftError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _stop_on_sigterm(step: str):
    """Make SIGTERM raise :class:`SignalStop` in the main thread; returns the previous handler (None elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        raise SignalStop(signum, f"{step}: stopped by SIGTERM; its half-written output was removed; re-run the step")

    return signal.signal(signal.SIGTERM, stop)
