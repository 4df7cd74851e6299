"""Waiting for a KFP run: ``llmft pipeline submit --wait`` and ``llmft pipeline wait RUN_ID``.

The run is read with kfp.Client's ``get_run`` (GET /apis/v2beta1/runs/{id}: a ``V2beta1Run``) every
``poll_s`` seconds; each change of its state is one line. Why not ``Client.wait_for_run_completion``: its end states
(kfp 2.17.3 ``kfp/client/client.py``, ``finish_states = ['succeeded', 'failed', 'skipped', 'error']``, about line
1389) lack CANCELED, so a cancelled run was waited on until the timeout; and it gives up on the first failed read.

The end state is the exit status: SUCCEEDED 0; FAILED, CANCELED, SKIPPED 1 with the run's error and its failed
tasks (what the user needs first). A timeout or Ctrl-C stops the waiting, never the run: exit 1 (never 200, which a
retrying caller would take as "submit again") or 130, with the run's link and the command that waits again. A read
that fails (a 5xx, the API unreachable for a moment) is retried up to :data:`MAX_READ_FAILURES` times in a row.
The clock and the sleep are arguments (tests: tests/fake_clock.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmft.trainer.errors import ConfigError, DataError, LlmftError, SignalStop

SUCCESS_STATES = ("SUCCEEDED",)
FAILURE_STATES = ("FAILED", "CANCELED", "SKIPPED")
"""A run's end states (kfp_server_api V2beta1RuntimeState); every other one (PENDING, RUNNING, CANCELING, PAUSED,
RUNTIME_STATE_UNSPECIFIED) is waited on."""
MAX_READ_FAILURES = 6


class RunFailed(DataError):
    """The run ended in a state other than SUCCEEDED (exit 1)."""


class WaitStopped(ConfigError):
    """Waiting stopped (the timeout passed, or reads kept failing) while the run goes on (exit 1)."""


@dataclass(frozen=True)
class RunLink:
    """What every line about the run names: its id, its KFP UI page, and the command that waits for it again."""

    run_id: str
    url: str
    wait_again: str


def run_url(ui_base: str, run_id: str) -> str:
    """The run's page in the KFP UI (the link kfp.Client prints: ``<ui host>/#/runs/details/<id>``)."""
    base = ui_base if ui_base.startswith(("http://", "https://")) else f"https://{ui_base}"
    return f"{base.rstrip('/')}/#/runs/details/{run_id}"


def state_of(run: Any) -> str:
    state = getattr(run, "state", None)
    return str(getattr(state, "value", state) or "RUNTIME_STATE_UNSPECIFIED").upper()


def wait_for_run(
    read: Callable[[str], Any],
    link: RunLink,
    *,
    timeout_s: float = 0.0,
    poll_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = print,
) -> Any:
    """Read the run until it ends; return it when it SUCCEEDED, raise :class:`RunFailed` when it ended otherwise,
    :class:`WaitStopped` on the timeout (``timeout_s`` > 0) or when reads keep failing."""
    started, last, failures = clock(), None, 0
    say(f"waiting for run {link.run_id} (Ctrl-C stops the waiting, not the run): {link.url}")
    try:
        while True:
            try:
                run = read(link.run_id)
                failures = 0
            except LlmftError:
                raise
            except Exception as exc:  # noqa: BLE001 - kfp_server_api.ApiException (5xx), urllib3's errors
                failures += 1
                if failures > MAX_READ_FAILURES:
                    why = f"the run could not be read {failures} times in a row ({exc})"
                    raise WaitStopped(_stopped(link, why)) from None
                run = None
            if run is not None:
                state = state_of(run)
                if state != last:
                    say(f"  {_elapsed(clock() - started):>8}  {state}")
                    last = state
                if state in SUCCESS_STATES:
                    return run
                if state in FAILURE_STATES:
                    raise RunFailed(failure_line(run, link))
            if timeout_s > 0 and clock() - started >= timeout_s:
                raise WaitStopped(_stopped(link, f"still {last or 'unread'} after --timeout {timeout_s:g} s"))
            sleep(poll_s)
    except KeyboardInterrupt:
        raise SignalStop(
            signal.SIGINT, f"stopped waiting (Ctrl-C); run {link.run_id} goes on: {link.url}. {link.wait_again}"
        ) from None


def failure_line(run: Any, link: RunLink) -> str:
    """What the user sees first about a run that did not succeed: its state, the error, the failed tasks."""
    line = f"run {link.run_id} {state_of(run)}"
    error = _message(getattr(run, "error", None))
    failed = failed_tasks(run)
    if error:
        line += f": {error}"
    if failed:
        line += f"; failed tasks: {'; '.join(failed)}"
    return f"{line}. Details: {link.url}"


def failed_tasks(run: Any) -> list[str]:
    """``name: error`` of each task of the run that FAILED (``run_details.task_details``), in the run's order."""
    details = getattr(getattr(run, "run_details", None), "task_details", None) or []
    out = []
    for task in details:
        if state_of(task) == "FAILED":
            name = getattr(task, "display_name", None) or getattr(task, "task_id", "?")
            message = _message(getattr(task, "error", None))
            out.append(f"{name}: {message}" if message else str(name))
    return out


def _message(status: Any) -> str:
    return " ".join(str(getattr(status, "message", "") or "").split())


def _stopped(link: RunLink, why: str) -> str:
    return f"stopped waiting: {why}; run {link.run_id} goes on: {link.url}. {link.wait_again}"


def _elapsed(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
