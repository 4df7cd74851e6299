"""One wall clock for the tests' launchers, simulators and fixtures (unique module name: tests/*/ dirs share
sys.path). No test compares the machine's clock with a fixed date: timestamps come from a clock like this one,
and .ci/run runs tests/k8s, tests/katib and tests/pipeline a second time with the wall clock a year ahead
(make test-clock-ahead)."""

from __future__ import annotations

import time


class FakeClock:
    """A wall clock for launchers and simulators (``clock=``, ``sleep=``): it starts at the real time of
    its creation (so a run with the machine's clock moved ahead moves it too) and advances only when
    slept on. Fixtures take their timestamps from it (:meth:`rfc3339`), never from a fixed date."""

    def __init__(self, start: float | None = None):
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def rfc3339(self, offset_s: float = 0.0) -> str:
        """The clock's time plus ``offset_s``, as Kubernetes writes a timestamp (RFC 3339, UTC, seconds)."""
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.now + offset_s))


def rfc3339_now(offset_s: float = 0.0) -> str:
    """The machine's time plus ``offset_s`` as Kubernetes writes it (for fixtures with no clock of their own)."""
    return FakeClock().rfc3339(offset_s)
