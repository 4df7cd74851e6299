"""Which tests share a pytest-xdist worker: ``make test`` and ``make test-clock-ahead`` run ``--dist loadgroup``, and
tests/conftest.py marks each test with the group this module gives it (CONTRIBUTING.md says why)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

ONE_WORKER_FIXTURES = ("local_run", "real_model_dir", "trained_adapter")
"""Session fixtures that cost a minute or more (the kfp.local pipeline run, the real model's conversion into .cache,
a LoRA trained by ``llmft train``): under pytest-xdist each worker would build its own, so the tests that use one
run in one worker."""


def xdist_group_of(item: Any) -> str | None:
    """The pytest-xdist group ``item`` runs in (``make test``: ``--dist loadgroup``), None where any worker may run it.

    Tests that use a fixture of ``ONE_WORKER_FIXTURES`` share that fixture's group. Tests that use a module- or
    class-scoped fixture of their own module (servers, a trained run, an executed notebook) stay with their module,
    so that it is built once, as in a single process (a conftest's module fixtures, such as tests/trainer's thread
    setting, are cheap and do not bind). A test with an ``xdist_group`` mark of its own keeps it."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    module = getattr(getattr(item, "module", None), "__name__", None)
    closest = {name: defs[-1] for name, defs in info.name2fixturedefs.items() if defs}
    for name in ONE_WORKER_FIXTURES:
        if name in closest and _module_of(closest[name]) != module:  # the shared one, not a module's namesake
            return name
    if any(f.scope in ("module", "class") and _module_of(f) == module for f in closest.values()):
        return item.nodeid.split("::", 1)[0]
    return None


def _module_of(fixturedef: Any) -> str | None:
    return getattr(fixturedef.func, "__module__", None)


def cpu_threads_per_worker(environ: Mapping[str, str], cores: int | None = None) -> int | None:
    """torch's (OpenMP's) threads for each pytest-xdist worker and every process it starts: the ``cores`` this
    process may run on (its CPU affinity when None) shared evenly among the workers, at least one. None outside
    xdist or with one worker: that process may use every core.

    OpenMP threads spin at their barriers; two workers that each start processes with one thread per core keep
    twice as many threads as cores busy, and every parallel region waits for a descheduled one. Measured on the
    2-core CI machine: two ``llmft train`` runs of the real model side by side took 205 s each with 2 threads and
    60 s each with 1 (CONTRIBUTING.md, "How long CI takes")."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers <= 1:
        return None
    return max(1, (cores if cores is not None else len(os.sched_getaffinity(0))) // workers)
