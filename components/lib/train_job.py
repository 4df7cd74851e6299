"""The `kubeflow` training backend as the train step uses it, and reading a finished run.

:func:`build_train_job_spec` turns the plan's :class:`~llmft.components.lib.plan.JobPlan` and the
trainer overrides into a :class:`TrainJobSpec` (the image, resources, node selector and Secrets
the plan names; the data PVC at the plan's mount path); :func:`run_on_cluster` runs it with
:func:`llmft.components.lib.pytorchjob.run_pytorchjob`. Katib trials are built by the same function.

Retries are safe: the job name derives from the pipeline run id, so a retried task finds
the job its previous attempt created. A Succeeded job is not run again; any other is
deleted and recreated, and the trainer resumes from the newest complete checkpoint in the
(equally stable) run directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any


def job_name(run_id: str) -> str:
    """A DNS-1035 PyTorchJob name, stable for a pipeline run (so retries find it)."""
    cleaned = re.sub(r"[^a-z0-9]", "", run_id.lower())[:12]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
    return f"llmft-{cleaned}-{digest}" if cleaned else f"llmft-{digest}"


def overrides_mapping(overrides: list[str]) -> dict[str, str]:
    """``["lora.r=16", ...]`` -> ``{"lora.r": "16", ...}`` (the form TrainJobSpec takes; a later key wins)."""
    return dict(item.split("=", 1) for item in overrides)


def build_train_job_spec(job, overrides: list[str], *, name: str | None = None, namespace: str | None = None):
    """The PyTorchJob spec of ``job`` (a JobPlan) running the trainer with ``overrides``.

    Every Secret key the plan names is a required reference (no ``optional``): a missing one is
    named by the plan step's preflight, not discovered by a pod stuck in CreateContainerConfigError."""
    from llmft.components.lib.pytorchjob import PvcMount, SecretEnv, TrainJobSpec

    secret_envs = tuple(SecretEnv(key, s.name, key, optional=False) for s in job.secrets for key in s.keys)
    return TrainJobSpec(
        name=name or job.name,
        namespace=namespace or None,
        image=job.image,
        overrides=overrides_mapping(overrides),
        num_nodes=job.num_workers,
        gpus_per_node=job.gpus_per_worker,
        cpu=job.resources.cpu,
        cpu_limit=job.resources.cpu,
        memory=job.resources.memory,
        pvcs=(PvcMount(job.pvc_name, job.mount_path),),
        secret_envs=secret_envs,
        env=dict(job.env),
        node_selector=dict(job.node_selector),
        labels=dict(job.labels),
    )


def run_on_cluster(job, overrides: list[str], *, poll_s: float = 30.0, cluster=None) -> dict:
    """Submit (or re-attach to) the run's PyTorchJob and wait up to ``job.timeout_s``; raises on Failed."""
    from llmft.components.lib.cluster import Cluster
    from llmft.components.lib.pytorchjob import build_pytorchjob, run_pytorchjob

    cluster = cluster or Cluster()
    timeout_s = float(job.timeout_s)
    spec = build_train_job_spec(job, overrides)
    pytorchjob = build_pytorchjob(spec)
    previous = _previous_job(cluster, spec.name)
    if previous is not None and _condition(previous, "Succeeded"):
        print(f"PyTorchJob {spec.name} already Succeeded (an earlier attempt of this task): not running it again")
        return {"name": spec.name, "namespace": cluster.namespace, "succeeded": True, "reused": True}
    if previous is not None:
        print(
            f"PyTorchJob {spec.name} exists from an earlier attempt: deleting it; training resumes from the "
            "newest complete checkpoint"
        )
        _delete_and_wait(cluster, spec.name, timeout_s=min(timeout_s, 300.0), poll_s=min(poll_s, 5.0))
    return run_pytorchjob(cluster, pytorchjob, timeout_s=timeout_s, poll_s=poll_s)


def _previous_job(cluster, name: str) -> dict | None:
    from llmft.components.lib.cluster import ClusterError
    from llmft.components.lib.pytorchjob import GROUP, PLURAL, VERSION

    try:
        return cluster.get_custom_object(GROUP, VERSION, PLURAL, name)
    except ClusterError as exc:
        if exc.status == 404:
            return None
        raise


def _condition(job: dict, kind: str) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def _delete_and_wait(cluster, name: str, *, timeout_s: float, poll_s: float) -> None:
    from llmft.components.lib.pytorchjob import GROUP, PLURAL, VERSION

    cluster.delete_custom_object(GROUP, VERSION, PLURAL, name)
    deadline = time.monotonic() + timeout_s
    while _previous_job(cluster, name) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"PyTorchJob {name} was not deleted within {timeout_s:.0f}s; delete it by hand and retry"
            )
        time.sleep(poll_s)


def read_training_manifest(run_dir: str | Path) -> dict[str, Any]:
    """``<run>/final/training_manifest.json`` (written by the trainer at the end of a run)."""
    path = Path(run_dir) / "final" / "training_manifest.json"
    if not path.is_file():
        from llmft.trainer.errors import LlmftError

        raise LlmftError(f"{path} is missing: the training run did not finish (no final/ folder in {run_dir})")
    return json.loads(path.read_text())


def training_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """Scalars of a training manifest for the step's KFP Metrics (final/best eval, tokens, time)."""
    out: dict[str, float] = {}
    for prefix, block in (("final", manifest.get("final_metrics") or {}), ("best", manifest.get("best") or {})):
        for key, value in block.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
                out[f"{prefix}_{key}"] = float(value)
    for key in ("steps", "tokens_seen", "wall_time_s", "world_size"):
        value = manifest.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out
