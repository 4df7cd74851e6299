"""A pipeline task's attempts: a permanent failure is one line with its exit code, and a retried attempt of a
task whose earlier attempt failed permanently ends at once, with that attempt's error.

Why: KFP's launcher exits 1 whatever the component returned (kubeflow/pipelines 2.4.1
``backend/src/v2/cmd/launcher-v2/main.go`` 46-50, ``glog.Exit``), and ``set_retry`` compiles to a
``retryStrategy`` without a ``retryPolicy`` (2.16.0 ``backend/src/v2/compiler/argocompiler/container.go``
655-676), which Argo reads as OnFailure: every failed attempt is retried, bad input (exit 1) like a full disk
(exit 200). The backoff before the next attempt cannot be skipped from inside the task; what the attempt
does can: :func:`task_attempt` records a permanent failure (exit 1 or 3, ``PERMANENT_CODES``) on the data
volume (``<root>/runs/<run id>.task-failures/<task>.json``: the attempt's pod, code and message), and a later
attempt that finds the recorded attempt still a failed node of the run's Argo Workflow fails at once with the
same line and code, without reading the dataset or training again. A run's Retry drops the failed pod nodes
(2.4.1 ``backend/src/common/util/workflow.go`` 220-231), so after a Retry (the input fixed, say) the task runs
again; an attempt that succeeds removes the record. Under kfp.local nothing is retried at all
(llmft/pipelines/llm_finetune.py ``local_pipeline``), and off a cluster no record is read.

A node's id is the pod name's hash with the Workflow's name before it (argo-workflows v3.4.17
``workflow/util/pod_name.go`` 53-70, pod names v2, the default; v1 names the pod by the node id).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.cluster import ClusterError
from llmft.components.lib.contracts.run_jobs import KFP_POD_ENV, on_kfp_cluster
from llmft.components.lib.jobs.launcher_pod import WORKFLOW, read_launcher_pod
from llmft.trainer.__main__ import describe_failure
from llmft.trainer.errors import EXIT_INTERNAL, EXIT_USER_ERROR
from llmft.trainer.io import atomic_write_text

PERMANENT_CODES = (EXIT_USER_ERROR, EXIT_INTERNAL)
"""Exit codes a retry cannot cure (llmft/trainer/errors.py)."""


def record_path(data_root: str, run_id: str, task: str) -> Path:
    return Path(data_root) / "runs" / f"{run_id}.task-failures" / f"{task}.json"


def node_ids(workflow: str, pod: str) -> tuple[str, ...]:
    """The Workflow node ids a pod of ``workflow`` may have: v2 ``<wf>-<hash>`` from ``<wf>-<template>-<hash>``,
    and v1 (the pod's own name)."""
    return (f"{workflow}-{pod.rsplit('-', 1)[-1]}", pod)


def still_failed(cluster, recorded_pod: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``recorded_pod`` is a failed node of this pod's run's Workflow (so this attempt retries it);
    False when anything cannot be read (the task then simply runs)."""
    launcher = read_launcher_pod(cluster, environ=environ, print_fn=lambda _line: None)
    if launcher.workflow is None:
        return False
    try:
        workflow = cluster.get_custom_object(*WORKFLOW, launcher.workflow.name)
    except ClusterError:
        return False
    nodes = (workflow.get("status") or {}).get("nodes") or {}
    found = [nodes[i] for i in node_ids(launcher.workflow.name, recorded_pod) if i in nodes]
    return any(n.get("phase") in ("Failed", "Error") for n in found)


@contextlib.contextmanager
def task_attempt(
    data_root: str, run_id: str, task: str, *, environ: Mapping[str, str] | None = None, cluster=None
) -> Iterator[None]:
    """Run the block as one attempt of ``task`` (module docstring): a failure is one ``error (exit N): ...``
    line on stderr and ``SystemExit(N)``; a permanent one is recorded for the task's retries."""
    env = os.environ if environ is None else environ
    record = record_path(data_root, run_id, task)
    if on_kfp_cluster(env) and record.is_file():
        earlier = json.loads(record.read_text())
        if still_failed(cluster or _cluster(), str(earlier.get("pod", "")), environ=env):
            code = int(earlier.get("exit_code", EXIT_USER_ERROR))
            print(
                f"error (exit {code}): an earlier attempt of this task ({earlier.get('pod')}) failed permanently; "
                f"not repeating it: {earlier.get('message', '')}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(code)
    try:
        yield
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else EXIT_USER_ERROR
        _note(record, env, code, f"it exited {code}; that attempt's log says why")
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and its exit code
        code, message = describe_failure(exc)
        _note(record, env, code, message)
        print(f"error (exit {code}): {message}", file=sys.stderr, flush=True)
        raise SystemExit(code) from None
    with contextlib.suppress(OSError):
        record.unlink(missing_ok=True)


def _note(record: Path, env: Mapping[str, str], code: int, message: str) -> None:
    """Record a permanent failure of this attempt (on a cluster: only Argo retries it)."""
    if code not in PERMANENT_CODES or not on_kfp_cluster(env):
        return
    with contextlib.suppress(OSError):
        body = {"pod": env.get(KFP_POD_ENV, ""), "exit_code": code, "message": message[:4000]}
        atomic_write_text(record, json.dumps(body, indent=2))


def _cluster():
    return cluster_module.Cluster()
