"""Progress and ETA of a training run: one estimate, one line format, for every place a person looks.

:class:`ProgressClock` turns "step s of T done at time t" into a :class:`Progress` (percent, elapsed, ETA);
:meth:`Progress.line` is the one plain progress line
(``progress: step 4/12 (33%), 1,234 tokens/s, loss 1.234, elapsed 1m20s, ETA 2m40s``). The trainer prints it
where its output is not a terminal (a pod's log, kfp.local, a pipe: tqdm's ``\\r`` redraws would pile up
there; on a terminal the tqdm bar shows the same numbers), logs the same numbers to MLflow and
posts them to Kubeflow Trainer's status server (llmft/trainer/trainer_status.py). The train step's
launcher (llmft/components/lib/jobs/pytorchjob_logs.py) passes these lines on at a bounded rate, and
``llmft pipeline run-local`` shows the running task's latest one (:func:`parse_line` reads them back).

The ETA is this process's pace times the steps left: the pace is measured from the end of the
first step this process trained (model load and the first compilation are behind it) and includes
the evaluations and checkpoints that recur on the way, so it estimates wall time, not compute time.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

PREFIX = "progress: "
"""Every progress line starts with this (a line of its own, no ``name=value`` pairs: Katib's collector skips it)."""
PLAIN_EVERY_S = 10.0
"""Plain progress lines: at most one per this many seconds (the last step's always)."""


@dataclass(frozen=True)
class Progress:
    """Where a run stands after ``step`` of ``total`` steps."""

    step: int
    total: int
    elapsed_s: float
    """Wall time of the run so far (every start of it: a resumed run adds its earlier starts')."""
    eta_s: float | None
    """Estimated wall time to the last step; None until this process has trained a step."""
    tokens_per_s: float | None = None
    loss: float | None = None

    @property
    def percent(self) -> float:
        return 100.0 * self.step / self.total if self.total > 0 else 100.0

    def line(self) -> str:
        parts = [f"step {self.step}/{self.total} ({self.percent:.0f}%)"]
        if _finite(self.tokens_per_s):
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        if _finite(self.loss):
            parts.append(f"loss {self.loss:.4g}")
        parts.append(f"elapsed {duration(self.elapsed_s)}")
        parts.append(f"ETA {duration(self.eta_s) if self.eta_s is not None else 'unknown'}")
        return PREFIX + ", ".join(parts)

    def metrics(self) -> dict[str, float]:
        """MLflow / TensorBoard numbers of the progress (the ETA only once known)."""
        numbers = {"progress_percent": self.percent, "elapsed_seconds": self.elapsed_s}
        if self.eta_s is not None:
            numbers["eta_seconds"] = self.eta_s
        return numbers


class ProgressClock:
    """Elapsed time and ETA of one process's steps (``clock`` injectable for tests)."""

    def __init__(self, total: int, start_step: int, elapsed_before_s: float = 0.0, clock=time.monotonic):
        self.total, self.start_step, self.clock = total, start_step, clock
        self.elapsed_before_s = elapsed_before_s
        self.t_start = clock()
        self.t_first: float | None = None  # end of this process's first step
        self.last_plain: float | None = None

    def at(self, step: int, *, tokens_per_s: float | None = None, loss: float | None = None) -> Progress:
        """The progress once ``step`` has finished (call once per finished step, or at log steps)."""
        now = self.clock()
        if self.t_first is None and step > self.start_step:
            self.t_first = now
        return Progress(
            step=step,
            total=self.total,
            elapsed_s=self.elapsed_before_s + (now - self.t_start),
            eta_s=self._eta(step, now),
            tokens_per_s=tokens_per_s,
            loss=loss,
        )

    def _eta(self, step: int, now: float) -> float | None:
        done, left = step - self.start_step, max(self.total - step, 0)
        if left == 0:
            return 0.0
        if done <= 0 or self.t_first is None:
            return None
        if done == 1:  # one step so far: its own time (load excluded), warm-up and all
            return (self.t_first - self.t_start) * left
        return (now - self.t_first) / (done - 1) * left

    def plain_due(self, step: int) -> bool:
        """Whether a plain line is due: the first, then at most one per PLAIN_EVERY_S, and the last step's."""
        now = self.clock()
        if step >= self.total or self.last_plain is None or now - self.last_plain >= PLAIN_EVERY_S:
            self.last_plain = now
            return True
        return False


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``, ``3d04h``: short and unambiguous."""
    if not _finite(seconds) or seconds < 0:
        return "unknown"
    total = int(round(seconds))
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


LINE = re.compile(r"progress: step (\d+)/(\d+) \((\d+)%\)")


def parse_line(text: str) -> tuple[int, int] | None:
    """(step, total) of a progress line anywhere in ``text`` (a launcher prefixes the pod's name), else None."""
    found = LINE.search(text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
