"""Pod parts every concern builds pods from: a Secret key as an environment variable, a volume mount, a
toleration (and the GPU one, defined once). The training jobs (jobs/), the InferenceService and the local
deployment (serving/) and the pipeline's GPU tasks (llmft/pipelines/llm_finetune.py) read them from here; they
lived in the PyTorchJob's module until issue 48 (a backend's module is no place for what every pod shares)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SecretEnv:
    """One environment variable filled from a Kubernetes Secret key (never from a parameter)."""

    env_name: str
    """Environment variable the container sees, e.g. ``HF_TOKEN``."""
    secret_name: str
    """Name of the Secret in the job's namespace."""
    key: str
    """Key inside the Secret."""
    optional: bool = True
    """When True a missing Secret or key leaves the variable unset instead of blocking the pod."""


DEFAULT_SECRET_ENVS: tuple[SecretEnv, ...] = (
    SecretEnv("HF_TOKEN", "llmft-hf-token", "HF_TOKEN"),
    SecretEnv("MLFLOW_TRACKING_URI", "llmft-mlflow", "MLFLOW_TRACKING_URI"),
    SecretEnv("MLFLOW_TRACKING_USERNAME", "llmft-mlflow", "MLFLOW_TRACKING_USERNAME"),
    SecretEnv("MLFLOW_TRACKING_PASSWORD", "llmft-mlflow", "MLFLOW_TRACKING_PASSWORD"),
    SecretEnv("LANGFUSE_PUBLIC_KEY", "llmft-langfuse", "LANGFUSE_PUBLIC_KEY"),
    SecretEnv("LANGFUSE_SECRET_KEY", "llmft-langfuse", "LANGFUSE_SECRET_KEY"),
    SecretEnv("LANGFUSE_HOST", "llmft-langfuse", "LANGFUSE_HOST"),
)
"""The Secrets (and keys) the project reads credentials from; all optional."""


@dataclass(frozen=True)
class PvcMount:
    """A PersistentVolumeClaim mounted into every replica."""

    claim_name: str
    """Name of the PVC (ReadWriteMany when the job has more than one node)."""
    mount_path: str
    """Absolute path inside the container."""
    sub_path: str = ""
    """Sub-directory of the volume to mount ('' = its root)."""
    read_only: bool = False
    """Mount read-only."""


@dataclass(frozen=True)
class Toleration:
    """A pod toleration (GPU nodes are commonly tainted ``nvidia.com/gpu:NoSchedule``)."""

    key: str
    """Taint key to tolerate."""
    operator: str = "Exists"
    """``Exists`` or ``Equal``."""
    value: str | None = None
    """Taint value (only with ``Equal``)."""
    effect: str | None = "NoSchedule"
    """``NoSchedule``, ``PreferNoSchedule``, ``NoExecute`` or None for all effects."""


GPU_TOLERATION = Toleration("nvidia.com/gpu")
