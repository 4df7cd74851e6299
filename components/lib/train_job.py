"""The `kubeflow` training backend as the train step uses it, and reading a finished run.

:func:`run_on_cluster` turns the trainer overrides into a :class:`TrainJobSpec` (the data
PVC at the same mount path as the pipeline's pods, GPU node placement, credentials from
Secrets), then runs it with :func:`llmft.components.lib.pytorchjob.run_pytorchjob`.

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

from llmft.components.lib.params import DATA_MOUNT

GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}
"""Node label that NVIDIA's GPU feature discovery puts on GPU nodes."""


def job_name(run_id: str) -> str:
    """A DNS-1035 PyTorchJob name, stable for a pipeline run (so retries find it)."""
    cleaned = re.sub(r"[^a-z0-9]", "", run_id.lower())[:12]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
    return f"llmft-{cleaned}-{digest}" if cleaned else f"llmft-{digest}"


def overrides_mapping(overrides: list[str]) -> dict[str, str]:
    """``["lora.r=16", ...]`` -> ``{"lora.r": "16", ...}`` (the form TrainJobSpec takes)."""
    return dict(item.split("=", 1) for item in overrides)


def build_train_job_spec(
    overrides: list[str],
    *,
    run_id: str,
    num_workers: int,
    gpus_per_worker: int,
    pvc_name: str,
    mlflow_tracking_uri: str = "",
    namespace: str | None = None,
):
    """The PyTorchJob spec of one pipeline run's training."""
    from llmft.components.lib.pytorchjob import DEFAULT_SECRET_ENVS, PvcMount, TrainJobSpec

    env = {"HF_HOME": f"{DATA_MOUNT}/hf-cache"}
    secret_envs = DEFAULT_SECRET_ENVS
    if mlflow_tracking_uri:  # the parameter wins over the Secret's key
        env["MLFLOW_TRACKING_URI"] = mlflow_tracking_uri
        secret_envs = tuple(s for s in secret_envs if s.env_name != "MLFLOW_TRACKING_URI")
    return TrainJobSpec(
        name=job_name(run_id),
        namespace=namespace or None,
        overrides=overrides_mapping(overrides),
        num_nodes=num_workers,
        gpus_per_node=gpus_per_worker,
        pvcs=(PvcMount(pvc_name, DATA_MOUNT),),
        secret_envs=secret_envs,
        env=env,
        node_selector=GPU_NODE_SELECTOR if gpus_per_worker else {},
        labels={"pipelines.kubeflow.org/run-id": re.sub(r"[^A-Za-z0-9_.-]", "", run_id)[:63]},
    )


def run_on_cluster(
    overrides: list[str],
    *,
    run_id: str,
    num_workers: int,
    gpus_per_worker: int,
    pvc_name: str,
    timeout_s: float,
    poll_s: float = 30.0,
    mlflow_tracking_uri: str = "",
    cluster=None,
) -> dict:
    """Submit (or re-attach to) the run's PyTorchJob and wait for it; raises on Failed."""
    from llmft.components.lib.cluster import Cluster
    from llmft.components.lib.pytorchjob import build_pytorchjob, run_pytorchjob

    cluster = cluster or Cluster()
    spec = build_train_job_spec(
        overrides,
        run_id=run_id,
        num_workers=num_workers,
        gpus_per_worker=gpus_per_worker,
        pvc_name=pvc_name,
        mlflow_tracking_uri=mlflow_tracking_uri,
    )
    job = build_pytorchjob(spec)
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
    return run_pytorchjob(cluster, job, timeout_s=timeout_s, poll_s=poll_s)


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
