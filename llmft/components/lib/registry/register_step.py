"""The register step's body: register the promoted adapter in MLflow, or record why nothing was registered.

* :func:`register_run`: the registration (lineage, the files logged beside it, the serving form's tags) of the
  plan's run, in the plan's MLflow; :func:`write_registration` writes registration.json and returns the KFP
  metadata; :func:`registration_line` is the step's last log line. llmft/components/register.py only calls them.

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
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from llmft.components.lib.contracts.choices import NO_MLFLOW_REASON
from llmft.components.lib.contracts.schema import RunPlan
from llmft.components.lib.registry.mlflow_registry import (
    Lineage,
    register_adapter,
    registration_from_run,
    registry_client,
)
from llmft.trainer.errors import TransientError
from llmft.trainer.io import TRAINING_MANIFEST, atomic_write_json
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


@dataclass(frozen=True)
class RegisterInputs:
    """What the register step reads besides the plan: its input artifacts' folders and metadata."""

    evaluation_dir: str
    """The evaluate step's output (evaluation.json)."""
    promoted_dir: str
    """The promote step's output (promotion.json)."""
    run_dir: str
    """The train step's output (training_manifest.json)."""
    promoted_adapter: str
    """The promoted adapter on the volume (the promote step's metadata ``path``)."""
    checkpoint: str
    """Which checkpoint was promoted (its metadata ``checkpoint``)."""
    cache_key: str
    """The tokenize step's cache key: the dataset hash of the lineage."""
    task_name: str
    """This task's name (a retried task finds the registration it made before by it)."""


def register_run(
    run_plan: RunPlan, inputs: RegisterInputs, *, form_tags: dict[str, str], form_files: tuple[Path, ...]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Register the promoted adapter in the plan's MLflow, or say why not (no MLflow configured): the facts of
    registration.json, and the evaluation they were registered with (None when nothing was registered)."""
    registry = run_plan.registry
    if not registry.enabled:
        return not_registered(registry.model_name), None
    lineage = Lineage(
        pipeline_run_id=run_plan.run_id,
        task=inputs.task_name,
        dataset_hash=inputs.cache_key,
        base_model=run_plan.trainer.model,
        dataset=run_plan.data.dataset,
        checkpoint=inputs.checkpoint,
    )
    evaluation = Path(inputs.evaluation_dir) / "evaluation.json"
    promotion = Path(inputs.promoted_dir) / "promotion.json"
    manifest = Path(inputs.run_dir) / TRAINING_MANIFEST
    evaluated = _read_json(evaluation)
    reg = registration_from_run(
        promoted_dir=inputs.promoted_adapter,
        evaluation=evaluated,
        training_manifest=_read_json(manifest),
        model_name=registry.model_name,
        experiment=registry.experiment,
        lineage=lineage,
        extra_artifacts=(evaluation, promotion, manifest, *form_files),  # a missing file is skipped
        tags=form_tags,
        promotion=_read_json(promotion) if promotion.is_file() else None,
    )
    mlflow_secret = next((s.name for s in run_plan.task_secrets if s.kind == "mlflow"), "")
    client = registry_client(registry.tracking_uri or None, mlflow_secret)
    uri = registry.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    with registry_store_faults(client, uri, registry.experiment):
        return register_adapter(reg, client=client), evaluated


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write_registration(facts: dict[str, Any], directory: str) -> dict[str, Any]:
    """registration.json in ``directory`` (written whole or not at all); returns the artifact's KFP metadata."""
    atomic_write_json(Path(directory) / "registration.json", facts)
    keys = ("registered", "model_name", "version", "is_champion")
    return {**{k: facts[k] for k in keys}, "run_id": facts.get("run_id"), "model_uri": facts.get("model_uri")}


def registration_line(facts: dict[str, Any]) -> str:
    """The step's last log line: what was registered and why it is (not) the champion, or why nothing was."""
    if not facts["registered"]:
        return f"not registered: {facts['reason']}"
    return (
        f"registered {facts['model_name']} version {facts['version']} ({facts['model_uri']}): {facts['alias_reason']}"
    )
