"""The run and its jobs as the cluster sees them: the run-id label, the job's name, where a step runs (a KFP task
pod or kfp.local), the API's timestamps and how a training job fails (the job-error types). No module of
llmft/components/lib is imported here (the contracts layer).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
from collections.abc import Mapping

from llmft.trainer.errors import LlmftError, TransientError

KFP_POD_ENV = "KFP_POD_NAME"
"""Set by the KFP backend in every task container (backend/src/v2/compiler/argocompiler/common.go
``commonEnvs``, 2.4.0 onwards); never by kfp.local, even when kfp.local runs inside a pod."""


def on_kfp_cluster(environ: Mapping[str, str] | None = None) -> bool:
    """True inside a KFP task pod on a cluster, False under kfp.local (see KFP_POD_ENV)."""
    return bool((os.environ if environ is None else environ).get(KFP_POD_ENV))


RUN_ID_LABEL = "pipelines.kubeflow.org/run-id"
"""Label every job, trial and Experiment of a pipeline run carries (value: :func:`run_label`)."""


def run_label(run_id: str) -> str:
    """The run-id label value: a valid label value (63 characters of [A-Za-z0-9_.-], alphanumeric ends)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "", run_id)[:63].strip("_.-")


JOB_WAIT_GRACE_S = 300
"""How long after the job's deadline the launcher still waits for the operator to mark it Failed."""


class JobFailedPermanently(LlmftError):
    """A replica exited 1-127 (bad input, or the trainer's restart budget spent): retrying cannot help."""


class JobTimedOut(TransientError):
    """The job ran into its deadline, or did not finish while this attempt waited (exit 200)."""


def job_name(run_id: str) -> str:
    """A DNS-1035 PyTorchJob name, stable for a pipeline run (so retries find it)."""
    cleaned = re.sub(r"[^a-z0-9]", "", run_id.lower())[:12]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
    return f"llmft-{cleaned}-{digest}" if cleaned else f"llmft-{digest}"


def parse_time(value: str | None) -> float | None:
    """An RFC 3339 timestamp of the API (``2026-01-01T00:00:00Z``) in epoch seconds; None if absent or unreadable."""
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class TrainingJobFailed(RuntimeError):
    """The PyTorchJob reached Failed; the message carries the master's last log lines."""
