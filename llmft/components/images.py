"""The one module where container images and the serving runtime are pinned.

Every image the pipeline, its components, the PyTorchJob and the Katib trials run
is named here, pinned by tag; nothing is installed when a container starts.

Override any of them with an environment variable set where the pipeline is
compiled or submitted (for an image you build yourself)::

    export LLMFT_TRAINER_IMAGE=registry.example.com/ml/llmft-trainer:0.1.0
    # or, immutable, by digest (what production should use):
    export LLMFT_TRAINER_IMAGE=registry.example.com/ml/llmft-trainer@sha256:<64 hex digits>

Get the digest of a pushed image with
``docker buildx imagetools inspect IMAGE --format '{{json .Manifest.Digest}}'``
(or ``crane digest IMAGE``). A reference without a tag or digest, or with the
tag ``latest``, is refused: it would make runs irreproducible.

Build both images with the Dockerfiles in ``docker/`` (see docker/README.md).
"""

from __future__ import annotations

import os
import re
import sys

from llmft.trainer.errors import ConfigError

IMAGE_TAG = "0.1.0"
"""Tag of the project's own images; equals the package version in setup.cfg."""

IMAGE_REGISTRY = "ghcr.io/kfp-llm-finetune"
"""Registry and namespace of the project's published images."""

IMAGE_UID = 1000
"""The uid (and gid) both images run as (docker/Dockerfile.*: ``useradd --uid 1000 --user-group``,
``USER 1000``): every pod that writes the shared volume runs as it (docs/cluster-guide.md, Volume ownership)."""

TRAINER_IMAGE_ENV = "LLMFT_TRAINER_IMAGE"
PIPELINE_IMAGE_ENV = "LLMFT_PIPELINE_IMAGE"
KATIB_IMAGE_ENV = "LLMFT_KATIB_IMAGE"
SERVING_RUNTIME_ENV = "LLMFT_SERVING_RUNTIME"
LOCAL_TRAINER_PYTHON_ENV = "LLMFT_LOCAL_TRAINER_PYTHON"

# A reference pinned by tag ([registry/]repo:tag) or by digest ([registry/]repo[:tag]@sha256:hex).
_REPO = r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+(?=/))?(?:/[a-z0-9]+(?:[._-]{1,2}[a-z0-9]+)*)*"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_PINNED_REF = re.compile(rf"^(?P<repo>{_REPO})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>sha256:[0-9a-f]{{64}}))?$")


def check_pinned(reference: str, *, source: str) -> str:
    """Return ``reference`` if it is pinned by a tag other than ``latest`` or by a digest.

    ``source`` names where the reference came from, for the error message.
    """
    match = _PINNED_REF.match(reference.strip())
    if not match:
        raise ConfigError(
            f"{source}: {reference!r} is not a valid image reference "
            "(expected [registry/]repository:tag or [registry/]repository@sha256:<digest>)"
        )
    tag, digest = match.group("tag"), match.group("digest")
    if digest is None and (tag is None or tag == "latest"):
        raise ConfigError(
            f"{source}: image {reference!r} is not pinned; use a version tag "
            "(repository:1.2.3) or a digest (repository@sha256:...), never 'latest'"
        )
    return reference.strip()


def _image(env_var: str, default: str) -> str:
    """The image named by ``env_var`` when set (and pinned), else ``default``."""
    override = os.environ.get(env_var, "").strip()
    if not override:
        return default
    return check_pinned(override, source=f"environment variable {env_var}")


TRAINER_IMAGE = _image(TRAINER_IMAGE_ENV, f"{IMAGE_REGISTRY}/llmft-trainer:{IMAGE_TAG}")
"""CUDA image with the package's ``trainer,deepspeed,gpu,executor,observe,eval,s3`` extras
(docker/Dockerfile.trainer; `executor` is kfp, for the components that run there).
Runs the PyTorchJob replicas and Katib trials, and components that import torch
(tokenize, evaluate)."""

PIPELINE_IMAGE = _image(PIPELINE_IMAGE_ENV, f"{IMAGE_REGISTRY}/llmft-pipeline:{IMAGE_TAG}")
"""Slim CPU image with the ``pipeline,katib`` extras (docker/Dockerfile.pipeline): the base
image of the orchestration components (launch PyTorchJob, register, deploy)."""

KATIB_IMAGE = _image(KATIB_IMAGE_ENV, PIPELINE_IMAGE)
"""Image of the component that creates and watches the Katib Experiment. The pipeline
image already carries the ``katib`` extra, so this is the same image unless overridden."""

SERVING_RUNTIME = os.environ.get(SERVING_RUNTIME_ENV, "").strip() or "kserve-huggingfaceserver"
"""KServe (Cluster)ServingRuntime that serves the adapter: the Hugging Face runtime,
started with ``--backend=vllm`` (see llmft/components/lib/serving/inferenceservice.py)."""

SERVING_MODEL_FORMAT = "huggingface"
"""``predictor.model.modelFormat.name`` the Hugging Face runtime declares."""

DOCKERFILES = {
    "trainer": ("docker/Dockerfile.trainer", "llmft-trainer", "trainer,deepspeed,gpu,executor,observe,eval,s3"),
    "pipeline": ("docker/Dockerfile.pipeline", "llmft-pipeline", "pipeline,katib"),
}
"""image role -> (Dockerfile path from the repository root, repository name, pip extras installed)."""


def all_images() -> dict[str, str]:
    """Every image reference in use, by role (for logs, summaries and tests)."""
    return {"trainer": TRAINER_IMAGE, "pipeline": PIPELINE_IMAGE, "katib": KATIB_IMAGE}


def dockerfile_roles() -> dict[str, str]:
    """Image reference -> the DOCKERFILES role that builds it: a component compiled with that base image
    runs in that Dockerfile's environment (the Katib image is the pipeline image's unless overridden,
    and then it must still carry the pipeline image's ``pipeline,katib`` extras)."""
    return {PIPELINE_IMAGE: "pipeline", KATIB_IMAGE: "pipeline", TRAINER_IMAGE: "trainer"}


def local_trainer_python() -> str:
    """The Python of the trainer processes the local backends start (``training_backend=local``,
    ``hpo_backend=local``: kfp.local only) where a cluster starts trainer-image pods: this process's,
    unless LLMFT_LOCAL_TRAINER_PYTHON names the trainer image's (tools/image_pipeline.py sets it, so a
    pipeline-image step never trains on its own torch-less Python)."""
    return os.environ.get(LOCAL_TRAINER_PYTHON_ENV, "").strip() or sys.executable
