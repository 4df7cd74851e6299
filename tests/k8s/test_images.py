"""Images are pinned in one module, overridable by pinned references only, and the
Dockerfiles agree with it (extras, tag, non-root user, torch first, nothing at start)."""

from __future__ import annotations

import configparser
import importlib
import re
import shlex

import pytest
from llmft.components import images
from llmft.trainer.errors import ConfigError


def _reload_with(monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return importlib.reload(images)


@pytest.fixture(autouse=True)
def _restore_images_module(monkeypatch):
    for name in (
        images.TRAINER_IMAGE_ENV,
        images.PIPELINE_IMAGE_ENV,
        images.KATIB_IMAGE_ENV,
        images.SERVING_RUNTIME_ENV,
    ):
        monkeypatch.delenv(name, raising=False)
    importlib.reload(images)
    yield
    monkeypatch.undo()
    importlib.reload(images)


def test_defaults_are_pinned_project_images():
    for role, reference in images.all_images().items():
        assert images.check_pinned(reference, source=role) == reference
        assert reference.endswith(f":{images.IMAGE_TAG}")
    assert images.KATIB_IMAGE == images.PIPELINE_IMAGE
    assert images.SERVING_RUNTIME == "kserve-huggingfaceserver" and images.SERVING_MODEL_FORMAT == "huggingface"


def test_image_tag_is_the_package_version(repo_root):
    setup = configparser.ConfigParser()
    setup.read(repo_root / "setup.cfg")
    assert images.IMAGE_TAG == setup["metadata"]["version"]


def test_environment_overrides_by_tag_or_digest(monkeypatch):
    digest = "registry.example.com/ml/llmft-trainer@sha256:" + "0123456789abcdef" * 4
    module = _reload_with(
        monkeypatch,
        LLMFT_TRAINER_IMAGE=digest,
        LLMFT_PIPELINE_IMAGE="localhost:5000/llmft-pipeline:2026.11.1",
        LLMFT_SERVING_RUNTIME="my-vllm-runtime",
    )
    assert module.TRAINER_IMAGE == digest
    assert module.PIPELINE_IMAGE == module.KATIB_IMAGE == "localhost:5000/llmft-pipeline:2026.11.1"
    assert module.SERVING_RUNTIME == "my-vllm-runtime"


@pytest.mark.parametrize(
    "reference",
    ["registry.example.com/ml/llmft-trainer", "llmft-trainer:latest", "Registry/Trainer:1", "trainer@sha256:short"],
)
def test_unpinned_or_malformed_overrides_are_refused(monkeypatch, reference):
    with pytest.raises(ConfigError, match="LLMFT_TRAINER_IMAGE"):
        _reload_with(monkeypatch, LLMFT_TRAINER_IMAGE=reference)


def _instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.parametrize("role", sorted(images.DOCKERFILES))
def test_dockerfiles_agree_with_images_module(repo_root, role):
    dockerfile, repository, extras = images.DOCKERFILES[role]
    steps = _instructions(repo_root / dockerfile)
    (base,) = [args for op, args in steps if op == "FROM"]
    assert re.search(r":[\w.-]+", base.split("/")[-1]) and ":latest" not in base, f"{base}: pin the base image"
    assert f'org.opencontainers.image.title="{repository}"' in dict(steps)["LABEL"]
    assert f'org.opencontainers.image.version="{images.IMAGE_TAG}"' in dict(steps)["LABEL"]
    assert any(op == "ARG" and args == f"EXTRAS={extras}" for op, args in steps)
    assert repository in images.all_images()[role]
    runs = [args for op, args in steps if op == "RUN"]
    install = next(i for i, r in enumerate(runs) if '".[${EXTRAS}]"' in r)
    assert "-c /tmp/constraints.txt" in runs[install] and "pip check" in runs[install]
    torch_runs = [i for i, r in enumerate(runs) if re.search(r'"torch==\$\{TORCH_VERSION\}"', r)]
    if "trainer" in extras:
        assert torch_runs and torch_runs[0] < install, "torch is installed first, alone, pinned"
        assert any(op == "ARG" and re.fullmatch(r"TORCH_VERSION=\d+\.\d+\.\d+", args) for op, args in steps)
    else:
        assert not torch_runs and "torch" not in extras
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1] not in ("0", "root"), "the image runs as a non-root user"
    start = [args for op, args in steps if op in ("CMD", "ENTRYPOINT")]
    assert start and not any("pip" in s for s in start), "nothing is installed when a container starts"
    assert (repo_root / f"{dockerfile}.dockerignore").is_file()


def _requirement_names(spec: str) -> list[str]:
    names = []
    for line in spec.strip().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("kfp-llm-finetune"):
            names.append(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_constraints_pin_every_requirement_the_images_install(repo_root):
    setup = configparser.ConfigParser()
    setup.read(repo_root / "setup.cfg")
    extras = setup["options.extras_require"]
    wanted = set(_requirement_names(setup["options"]["install_requires"]))
    for role in images.DOCKERFILES.values():
        for extra in role[2].split(","):
            wanted |= set(_requirement_names(extras[extra]))
    pins = {}
    for line in (repo_root / "docker/constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"docker/constraints.txt: {line!r} must be an exact == pin"
            pins[name.lower().replace("_", "-")] = version
    assert "torch" not in pins, "torch is pinned by ARG TORCH_VERSION and installed first, alone"
    assert sorted(wanted - set(pins)) == [], "every install requirement must be pinned"
    trainer_steps = " ".join(
        shlex.split(args)[-1]
        for op, args in _instructions(repo_root / "docker/Dockerfile.trainer")
        if op == "RUN" and "deepspeed==" in args
    )
    assert f"deepspeed=={pins['deepspeed']}" in trainer_steps
