"""Which tests share a pytest-xdist worker: ``make test`` and ``make test-clock-ahead`` run ``--dist loadgroup``, and
tests/conftest.py marks each test with the group this module gives it (CONTRIBUTING.md says why)."""

from __future__ import annotations

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
