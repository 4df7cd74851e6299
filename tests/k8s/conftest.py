"""Fixtures of the Kubernetes-facing tests: real CRD schemas, a Pod validator
(kubernetes-validate), and a Cluster wired to fakes at the kubernetes-client boundary."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import yaml
from k8s_fakes import FakeCoreV1Api, FakeCustomObjectsApi
from llmft.components.lib.cluster import Cluster

KUBERNETES_VERSION = "1.30.0"
"""Core schemas to validate pod pieces against (kubernetes client 30.x = Kubernetes 1.30)."""


def load_crd_schema(path: Path, version: str) -> dict:
    """The openAPIV3Schema of one served version of a CRD file."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(path.read_text(), Loader=loader)
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version and entry.get("served"):
            return entry["schema"]["openAPIV3Schema"]
    raise AssertionError(f"{path}: no served version {version}")


def schema_validator(schema: dict) -> Callable[[dict], list[str]]:
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)

    def errors(obj: dict) -> list[str]:
        return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]

    return errors


@pytest.fixture(scope="session")
def pytorchjob_crd_errors(crd_dir) -> Callable[[dict], list[str]]:
    """PyTorchJob -> list of violations of the real CRD schema (kubeflow.org/v1)."""
    return schema_validator(load_crd_schema(crd_dir / "kubeflow.org_pytorchjobs.yaml", "v1"))


@pytest.fixture(scope="session")
def isvc_crd_errors(crd_dir) -> Callable[[dict], list[str]]:
    """InferenceService -> list of violations of the real CRD schema (serving.kserve.io/v1beta1)."""
    return schema_validator(load_crd_schema(crd_dir / "serving.kserve.io_inferenceservices.yaml", "v1beta1"))


@pytest.fixture(scope="session")
def validate_pod() -> Callable[[dict, dict], None]:
    """Validate (metadata, pod spec) as a core/v1 Pod with kubernetes-validate (strict: no unknown fields)."""
    import kubernetes_validate

    def check(metadata: dict, spec: dict) -> None:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check", **metadata}, "spec": spec}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)

    return check


@pytest.fixture
def fake_custom_api() -> FakeCustomObjectsApi:
    return FakeCustomObjectsApi()


@pytest.fixture
def fake_core_api() -> FakeCoreV1Api:
    return FakeCoreV1Api()


@pytest.fixture
def fake_cluster(fake_custom_api, fake_core_api) -> Cluster:
    """A Cluster in namespace 'team-a' whose kubernetes APIs are the fakes."""
    return Cluster("team-a", custom_api=fake_custom_api, core_api=fake_core_api)
