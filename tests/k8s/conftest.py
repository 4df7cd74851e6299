"""Fixtures of the Kubernetes-facing tests: real CRD schemas, a Pod validator
(kubernetes-validate), and a Cluster wired to fakes at the kubernetes-client boundary."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import yaml
from k8s_fakes import FakeCoreV1Api, FakeCustomObjectsApi
from sim_plans import SIM_NAMESPACE

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


# --- the controller simulator (cluster_sim.py) and what its pods read --------------------------------


@pytest.fixture(scope="session")
def sim_volume(tmp_path_factory, tiny_model_dir):
    """The data PVC of the simulated cluster: the tiny model and the shipped sample, prepared and
    tokenized by the real data layer, under one root (mounted at that same path in every pod)."""
    import shutil

    from llmft.demo import sample_path
    from llmft.trainer.data.prepare import prepare_dataset
    from llmft.trainer.data.tokenize import tokenize_dataset

    root = tmp_path_factory.mktemp("pvc")
    shutil.copytree(tiny_model_dir, root / "base-models" / "tiny")
    prepare_dataset(str(sample_path("alpaca_demo")), root / "datasets" / "demo", val_fraction=0.1)
    tokenize_dataset(
        root / "datasets" / "demo",
        str(root / "base-models" / "tiny"),
        root / "tokenized" / "demo",
        max_length=128,
        pack=True,
        num_proc=1,
    )
    return root


@pytest.fixture
def sim(tmp_path, sim_volume, fake_custom_api, fake_core_api):
    """A ClusterSim over the fakes, the volume mounted; every container is killed at teardown."""
    from cluster_sim import ClusterSim

    cluster_sim = ClusterSim(
        fake_custom_api, fake_core_api, SIM_NAMESPACE, tmp_path / "pods", volumes={"llmft-data": sim_volume}
    )
    yield cluster_sim
    cluster_sim.stop()
