"""Images are pinned in one module, overridable by pinned references only, and the
Dockerfiles agree with it (extras, tag, non-root user, torch first, nothing at start)."""

from __future__ import annotations

import configparser
import importlib
import importlib.util
import io
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from llmft import SUBPACKAGES
from llmft.components import images
from llmft.trainer.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "tools"))  # image_check imports image_pipeline from beside it
_spec = importlib.util.spec_from_file_location("image_check", REPO_ROOT / "tools" / "image_check.py")
image_check = importlib.util.module_from_spec(_spec)
sys.modules["image_check"] = image_check  # dataclasses look their module up there
_spec.loader.exec_module(image_check)


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
    return [(step.op, step.args) for step in image_check.instructions(path)]


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


# The Dockerfiles as tools/image_check.py (make image-check, run by .ci/run) reads and runs them.


@pytest.mark.parametrize("role", sorted(images.DOCKERFILES))
def test_smoke_lines_import_the_installed_package_away_from_the_sources(repo_root, role):
    """A smoke line names modules as the wheel installs them (``llmft.*``, never a bare folder such as
    ``trainer``), and runs where the copied sources cannot shadow the install (`python -c` puts its working
    directory first on sys.path)."""
    from llmft import SUBPACKAGES

    dockerfile = repo_root / images.DOCKERFILES[role][0]
    steps = image_check.instructions(dockerfile)
    source_dirs = {
        step.args for i, step in enumerate(steps) if step.op == "WORKDIR" and _copies_sources_after(steps, i)
    }
    smokes = image_check.smoke_lines(dockerfile)
    assert smokes, f'{dockerfile.name}: no smoke line (python -c "import ...")'
    for argv, workdir in smokes:
        modules = image_check.imported_modules(argv[2])
        bare = [m for m in modules if m.split(".")[0] in SUBPACKAGES]
        assert not bare, f"{dockerfile.name}: {bare} is not installed; the wheel installs llmft.{bare[0]}"
        for module in (m for m in modules if m.split(".")[0] == "llmft"):
            assert importlib.util.find_spec(module) is not None, f"{dockerfile.name}: no module {module}"
        assert workdir not in source_dirs, f"{dockerfile.name}: the smoke line runs in {workdir}, beside the sources"
    assert any("llmft" in m for argv, _ in smokes for m in image_check.imported_modules(argv[2]))


def _copies_sources_after(steps, index: int) -> bool:
    """Whether the WORKDIR at ``index`` receives COPYs to a relative destination (the package sources)."""
    for step in steps[index + 1 :]:
        if step.op == "WORKDIR":
            return False
        if step.op == "COPY" and not step.args.split()[-1].startswith("/"):
            return True
    return False


@pytest.mark.parametrize("role", sorted(images.DOCKERFILES))
def test_the_build_context_holds_every_folder_the_package_maps(repo_root, role):
    """Each image COPYs, and its .dockerignore lets through, llmft/ (every package is a folder in it) and
    the files the wheel's metadata reads; the check builds its wheel from exactly these."""
    mapped = {"llmft", *(f"llmft/{name}" for name in SUBPACKAGES)}
    dockerfile = repo_root / images.DOCKERFILES[role][0]
    copied = {
        src.rstrip("/") for srcs, dest in image_check.copies(image_check.instructions(dockerfile)) for src in srcs
    }
    needed = mapped | {"setup.cfg", "pyproject.toml", "README.md", "docker/constraints.txt"}
    assert sorted({"llmft", *needed - mapped} - copied) == [], f"{dockerfile.name} does not COPY them"
    assert not copied & set(SUBPACKAGES), "the top-level trainer/, ... hold no code: COPY llmft/ only"
    patterns = image_check.dockerignore_patterns(dockerfile)
    for name in mapped:
        assert image_check.dockerignore_keeps(patterns, f"{name}/__init__.py"), f"the .dockerignore drops {name}/"
    assert image_check.dockerignore_keeps(patterns, "setup.cfg")
    for dropped in (
        ".venv/bin/python",
        "llmft/__pycache__/cli.cpython-311.pyc",
        "benchmarks/results/a.json",
        ".git/HEAD",
    ):
        assert not image_check.dockerignore_keeps(patterns, dropped), dropped


def test_the_build_context_holds_the_package_files_and_no_link(repo_root, tmp_path):
    """The check's context holds what Docker's COPY llmft/ brings: the package's own files, no link."""
    context = image_check.build_context(repo_root / images.DOCKERFILES["trainer"][0], tmp_path / "ctx")
    for name in SUBPACKAGES:
        folder = context / "llmft" / name
        assert not folder.is_symlink() and (folder / "__init__.py").is_file(), f"the context lacks llmft/{name}/"
    assert not [p for p in context.rglob("*") if p.is_symlink()], "a link in the build context"


def test_the_check_runs_the_trainer_dockerfile_as_written_but_torch_and_the_source(repo_root, tmp_path):
    """What `make image-check` runs for the trainer image: every RUN command of the Dockerfile in order
    (image paths moved under the stand-in root), the wheel instead of the source tree with the same extras
    and constraints, the CPU torch instead of the CUDA index; only system set-up skipped; the CMD last."""
    dockerfile, _, extras = images.DOCKERFILES["trainer"]
    image = image_check.Image("trainer", repo_root / dockerfile, tmp_path / "root")
    wheel = tmp_path / "dist" / "kfp_llm_finetune-0.1.0-py3-none-any.whl"
    plan = image_check.plan(image, wheel, "torch==2.13.0")
    skipped = [c for c in plan if isinstance(c, str)]
    commands = [c for c in plan if not isinstance(c, str)]
    assert [s.split(":")[1].split()[0] for s in skipped] == ["apt-get", "apt-get", "rm", "useradd"]
    constraints = str(tmp_path / "root" / "tmp" / "constraints.txt")
    installs = [c.argv for c in commands if c.argv[:2] == ["pip", "install"]]
    assert ["pip", "install", "torch==2.13.0"] in installs, "CPU torch, no CUDA index"
    assert ["pip", "install", "-c", constraints, f"{wheel}[{extras}]"] in installs
    assert ["pip", "install", "--no-build-isolation", "-c", constraints, "deepspeed==0.19.8"] in installs
    smokes = [argv for argv, _ in image_check.smoke_lines(repo_root / dockerfile)]
    assert [c.argv for c in commands if image_check.is_smoke(c.argv)] == smokes
    assert commands[-1].argv == ["llmft", "--help"] and commands[-1].cwd == str(tmp_path / "root" / "home" / "llmft")
    env = image.environment({"PATH": "/usr/bin", "PYTHONPATH": str(repo_root), "PIP_NO_CACHE_DIR": "1"})
    assert (
        env["PATH"] == f"{tmp_path}/root/opt/llmft/bin:/usr/bin" and env["VIRTUAL_ENV"] == f"{tmp_path}/root/opt/llmft"
    )
    assert "PYTHONPATH" not in env and "PIP_NO_CACHE_DIR" not in env and env["DS_BUILD_OPS"] == "0"
    for command in commands:
        assert not any(re.search(r"(?<![\w/])/(opt|tmp|home)/", a) for a in command.argv[2:] if str(tmp_path) not in a)


def test_the_dockerfile_reader(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text(
        "# comment\nFROM python:3.11\nARG EXTRAS=a,b\nENV ROOT=/opt/x \\\n    PATH=/opt/x/bin:$PATH\n"
        "COPY setup.cfg ./\n"
        'RUN pip install ".[${EXTRAS}]" \\\n # a comment inside\n'
        " && python -c \"import a, b; import c.d as e; print('&&')\"\n"
        'CMD ["llmft", "--help"]\n'
    )
    steps = image_check.instructions(path)
    assert [(s.op, s.line) for s in steps] == [
        ("FROM", 2),
        ("ARG", 3),
        ("ENV", 4),
        ("COPY", 6),
        ("RUN", 7),
        ("CMD", 10),
    ]
    assert image_check.build_args(steps) == {"EXTRAS": "a,b"}
    assert image_check.env_assignments(steps) == [("ROOT", "/opt/x"), ("PATH", "/opt/x/bin:$PATH")]
    assert image_check.shell_commands(steps[4]) == [
        ["pip", "install", ".[${EXTRAS}]"],
        ["python", "-c", "import a, b; import c.d as e; print('&&')"],
    ]
    assert image_check.imported_modules("import a, b; import c.d as e; print('&&')") == ["a", "b", "c.d"]
    assert image_check.start_command(steps) == ["llmft", "--help"]
    assert image_check.expand("${EXTRAS}-$EXTRAS-$NONE", {"EXTRAS": "a"}) == "a-a-$NONE"
    with pytest.raises(image_check.DockerfileError, match="line 1: shell operator"):
        image_check.shell_commands(image_check.Step("RUN", "pip install x || true", 1))
    with pytest.raises(image_check.DockerfileError, match="exec form"):
        image_check.start_command([image_check.Step("CMD", "llmft --help", 3)])


def test_the_check_never_runs_this_machines_python_for_the_images(tmp_path, monkeypatch):
    """Inside an image's environment, a command that does not resolve into the image's venv is refused before it
    runs (a wrong PATH would otherwise install the image into this machine's own Python)."""
    env = {"PATH": f"{tmp_path}/root/opt/llmft/bin:/usr/bin:/bin", "VIRTUAL_ENV": f"{tmp_path}/root/opt/llmft"}
    monkeypatch.setattr(image_check.subprocess, "run", lambda *a, **k: pytest.fail("ran a command outside the venv"))
    with pytest.raises(image_check.CheckFailed, match="not from the image's venv"):
        image_check.run(["sh", "-c", "pip install x"], env=env, cwd=tmp_path, what="test")


def test_the_torch_install_takes_the_given_spec_and_index(repo_root, tmp_path):
    image = image_check.Image("trainer", repo_root / images.DOCKERFILES["trainer"][0], tmp_path)
    plan = image_check.plan(image, tmp_path / "x.whl", "torch==9.9.9", "https://index.example/cpu")
    (torch,) = [c for c in plan if not isinstance(c, str) and any(a.startswith("torch") for a in c.argv)]
    assert torch.argv == ["pip", "install", "torch==9.9.9", "--index-url", "https://index.example/cpu"]
    assert "cu128" in torch.note


COMPILED_HEADER = "import kfp\nfrom kfp import dsl\nfrom kfp.dsl import *\nfrom typing import *\n\n"
"""How KFP starts the program of a lightweight component it compiles (the component's source follows)."""


@pytest.mark.parametrize(
    "body, error",
    [
        ("    import json\n    from llmft.components.lib.contracts.schema import read_plan\n", None),
        ("    from llmft.components.lib.plan.build import no_such_name\n", "no_such_name"),
        (
            "    if plan:\n        from components.lib.plan import read_plan\n",
            "No module named 'components'",
        ),
    ],
)
def test_the_executor_probe_resolves_every_import_in_a_components_body(tmp_path, monkeypatch, capsys, body, error):
    """What the check runs in an image for each compiled component: KFP's loader, the function by name, then every
    import in its body, conditional ones too; an import the image cannot satisfy fails it."""
    program = COMPILED_HEADER + f"def step(plan: Input[Artifact]):\n{body}"
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps([[program, "step"]])))
    monkeypatch.chdir(tmp_path)  # as in the image: no checkout on sys.path to shadow the installed package
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(REPO_ROOT))])
    monkeypatch.setitem(sys.modules, "ephemeral_component", None)
    if error is None:
        exec(image_check.EXECUTOR_PROBE, {})
        assert capsys.readouterr().out == "step: llmft.components.lib.contracts.schema.read_plan\n"
    else:
        with pytest.raises(ImportError, match=error):
            exec(image_check.EXECUTOR_PROBE, {})


def test_the_images_build_side_by_side_and_each_log_prints_whole_then_the_first_failure(monkeypatch, capsys, tmp_path):
    """make image-check builds both images at once (tools/image_check.py build_images): each build's lines are held
    and printed together, in the registry's order, so the log reads as two builds, not an interleaving; a failed
    build's lines still print before its error is raised."""
    import threading
    from types import SimpleNamespace

    both_running = threading.Barrier(2, timeout=30)  # each build waits for the other: they ran at the same time

    def build_image(image, wheel, args):
        image_check.log(f"{image.role}: first")
        both_running.wait()
        image_check.log(f"{image.role}: last")
        if image.role == "pipeline":
            raise image_check.CheckFailed("pipeline: pip check failed")
        return {"ROLE": image.role}

    monkeypatch.setattr(
        image_check, "Image", lambda role, dockerfile, root: SimpleNamespace(role=role, dockerfile=root)
    )
    monkeypatch.setattr(image_check, "build_context", lambda dockerfile, destination: destination)
    monkeypatch.setattr(image_check, "build_wheel", lambda context, out: out / "x.whl")
    monkeypatch.setattr(image_check, "build_image", build_image)
    with pytest.raises(image_check.CheckFailed, match="pipeline: pip check failed"):
        image_check.build_images({"trainer": "a", "pipeline": "b"}, tmp_path, SimpleNamespace())
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:5] == ["trainer: first", "trainer: last", "pipeline: first", "pipeline: last"], lines
    image_check.log("after the builds")  # the thread's hold ends with its build: this thread prints at once
    assert capsys.readouterr().out == "after the builds\n"
