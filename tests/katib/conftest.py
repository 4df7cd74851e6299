"""Fixtures of the Katib tests (helpers live in katib_helpers.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import jsonschema
import pytest
import yaml
from katib_helpers import build_body

from llmft.katib.experiment import ALGORITHMS


@pytest.fixture(scope="session")
def bodies() -> dict[str, dict]:
    """One Experiment per selectable algorithm (built once per session)."""
    return {alg: build_body(f"algorithm={alg}") for alg in ALGORITHMS}


@pytest.fixture
def body(bodies) -> dict:
    """A fresh copy of the default (tpe) Experiment, safe to mutate."""
    return copy.deepcopy(bodies["tpe"])


@pytest.fixture(scope="session")
def pytorchjob_schema_errors(crd_dir) -> Callable[[dict], list[str]]:
    """PyTorchJob dict -> violations of the real kubeflow.org/v1 PyTorchJob CRD schema."""
    crd = yaml.load(
        (crd_dir / "kubeflow.org_pytorchjobs.yaml").read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    )
    schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == "v1")
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    return lambda obj: [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
