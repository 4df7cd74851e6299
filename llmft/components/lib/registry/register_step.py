"""The register step's body: register the promoted adapter in MLflow, or record why nothing was registered.

* No MLflow server configured (the plan's ``registry.enabled`` false): nothing is contacted; registration.json
  says ``registered: false`` and why (:func:`not_registered`), and the deploy step serves the promoted adapter.
* A full store is a transient fault with its own name (exit 200; the step's retry policy retries it):
  a SQLite tracking store that reports "database or disk is full" names the database file and the free
  space of its disk; a full artifact store (``ENOSPC`` / ``EDQUOT`` while MLflow copies the adapter into
  it) names the store's location and its free space, not the adapter it was reading
  (:func:`registry_fault`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from llmft.components.lib.plan.checks import NO_MLFLOW_REASON
from llmft.trainer.errors import TransientError
from llmft.trainer.mlflow_settings import redact_credentials
from llmft.trainer.storage import disk_fault, free_bytes, human

FULL_STORE_TEXTS = ("database or disk is full", "disk I/O error")
"""What SQLite says when its file cannot grow (sqlite3 SQLITE_FULL, SQLITE_IOERR), through SQLAlchemy or a server."""


def not_registered(model_name: str, reason: str = NO_MLFLOW_REASON) -> dict[str, Any]:
    """registration.json of a run that registered nothing."""
    return {"registered": False, "reason": reason, "model_name": model_name, "version": None, "is_champion": None}


class RegistryStoreFull(TransientError):
    """The MLflow tracking or artifact store cannot take more data (exit 200)."""


def _sqlite_path(tracking_uri: str) -> Path | None:
    parts = urlsplit(tracking_uri)
    if parts.scheme != "sqlite":
        return None
    return Path(unquote(parts.path[1:] if parts.path.startswith("//") else parts.path))


def _local_path(uri: str) -> Path | None:
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):
        return Path(unquote(parts.path))
    return None


def _free(path: Path | None) -> str:
    space = free_bytes(path) if path is not None else None
    return f"{human(space[0])} free of {human(space[1])} on its disk" if space else "free space unknown"


def registry_fault(exc: BaseException, tracking_uri: str, artifact_location: str | None) -> RegistryStoreFull | None:
    """The one-line transient error for a full tracking or artifact store, else None (not a store fault)."""
    text = str(exc)
    if any(needle in text for needle in FULL_STORE_TEXTS):
        db = _sqlite_path(tracking_uri)
        store = (
            f"the MLflow tracking store {db}"
            if db
            else f"the MLflow tracking server {redact_credentials(tracking_uri)}"
        )
        return RegistryStoreFull(
            f"{store} is full ({next(n for n in FULL_STORE_TEXTS if n in text)}): {_free(db.parent if db else None)}. "
            "Fix: free space there or move the store, then re-run the step (exit 200 is retried)"
        )
    code = disk_fault(exc)
    if code is None:
        return None
    where = artifact_location or "(unknown)"
    local = _local_path(where) if artifact_location else None
    return RegistryStoreFull(
        f"the MLflow artifact store {where} cannot take the model: {os.strerror(code)} (errno {code}); "
        f"{_free(local)}. Fix: free space there or give the experiment another artifact location, then re-run the "
        "step (exit 200 is retried)"
    )


MLFLOW_DB_LOGGER = "mlflow.store.db.utils"
"""MLflow's SQL store logs every database error with its traceback before raising it (``make_managed_session``)."""


@contextlib.contextmanager
def registry_store_faults(client, tracking_uri: str, experiment: str) -> Iterator[None]:
    """Turn a full tracking or artifact store inside the block into :class:`RegistryStoreFull` (MLflow's own
    traceback log of the database error is held back: the step's one line says it; any other error is raised
    with its traceback)."""
    db_log = logging.getLogger(MLFLOW_DB_LOGGER)
    level = db_log.level
    db_log.setLevel(logging.CRITICAL)
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a store fault
        fault = registry_fault(exc, tracking_uri, _artifact_location(client, experiment))
        if fault is None:
            raise
        raise fault from exc
    finally:
        db_log.setLevel(level)


def _artifact_location(client, experiment: str) -> str | None:
    with contextlib.suppress(Exception):  # reading may fail too on a sick store: the message says unknown
        found = client.get_experiment_by_name(experiment) if client is not None else None
        return found.artifact_location if found is not None else None
    return None
