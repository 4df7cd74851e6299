"""Prove both images without Docker (`make image-check`; CI runs it from .ci/run).

For each Dockerfile in ``llmft.components.images.DOCKERFILES``:

1. build the project's wheel from the files the Dockerfile COPYs into its source folder,
   filtered by its ``.dockerignore`` (what BuildKit would send);
2. run the Dockerfile's RUN commands in order, as written, in a folder standing for the image's
   ``/`` (outside the checkout, so the checkout cannot shadow the installed package). Rewritten:
   the image's paths (to that folder), the source install ``pip install ".[EXTRAS]"`` (to the wheel,
   same extras and constraints) and, in the trainer image, the CUDA torch (to ``--torch-spec``, the
   CPU wheel `make install` uses). Skipped: apt-get, rm, useradd (system set-up). Any other
   command is run, so the smoke lines and ``pip check`` run exactly as the Dockerfile says;
3. run the image's start command (CMD).

Then what the pipeline and the job manifests put into those containers: ``llmft train --help``;
each compiled component's executor (`llmft pipeline compile`, both pipelines): the KFP executor
module, the component's own source as compiled, its function, and every import in its body,
loaded the way ``kfp.dsl.executor_main`` loads them; and the PyTorchJob and TrainJob containers
(`llmft pipeline render-job`) with their own command and args plus ``--print-config``. Last, both pipelines
run through kfp.local on the demo's inputs with every task on the Python of its component's image
(tools/image_pipeline.py): a step that imports what its image lacks fails the check.

Not covered: the Python version of the trainer image (3.12 there; the venvs are made by the python3 on
this machine's PATH), CUDA, the non-root USER, and the Katib trial's ``sh -c`` wrapper (its ``llmft train``
arguments are the PyTorchJob's). pip's cache is reused.

    python tools/image_check.py [--torch-spec torch==2.13.0] [--torch-index URL] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from image_pipeline import PLACEHOLDER_MLFLOW, PipelineCheckFailed, check_pipelines  # tools/, beside this file

REPO_ROOT = Path(__file__).resolve().parents[1]
SKIPPED_COMMANDS = {"apt-get": "system packages", "rm": "apt lists", "useradd": "the image's user"}
"""First words of RUN commands the check does not run (system set-up of the base image)."""
SOURCE_INSTALL = re.compile(r"^\.(\[[^\]]*\])?$")
"""``pip install`` argument naming the source tree copied into the WORKDIR: ``.`` or ``.[extras]``."""


class CheckFailed(RuntimeError):
    """A step of an image failed: the image would not build or its containers would not run."""


# ---------------------------------------------------------------------------------------------
# Reading a Dockerfile (pure; tests/k8s/test_images.py checks it on the real files)


class DockerfileError(ValueError):
    """A Dockerfile construct this reader does not understand (the message names the line)."""


@dataclass(frozen=True)
class Step:
    op: str
    args: str
    line: int


def instructions(path: Path) -> list[Step]:
    """The instructions of ``path`` in order: continuation lines joined, comments dropped."""
    steps: list[Step] = []
    pending, start = "", 0
    for number, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        start = start if pending else number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        op, _, args = (pending + line).partition(" ")
        steps.append(Step(op.upper(), args.strip(), start))
        pending = ""
    return steps


def expand(text: str, variables: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced from ``variables`` (unknown names left as they are)."""
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def build_args(steps: list[Step]) -> dict[str, str]:
    """ARG name -> default value."""
    return {name: value for name, _, value in (s.args.partition("=") for s in steps if s.op == "ARG")}


def env_assignments(steps: list[Step]) -> list[tuple[str, str]]:
    """(name, value as written) of every ENV, in order."""
    pairs = []
    for step in (s for s in steps if s.op == "ENV"):
        for word in shlex.split(step.args):
            name, sep, value = word.partition("=")
            if not sep:
                raise DockerfileError(f"line {step.line}: write ENV as NAME=value")
            pairs.append((name, value))
    return pairs


def copies(steps: list[Step]) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY."""
    found = []
    for step in (s for s in steps if s.op == "COPY"):
        words = shlex.split(step.args)
        if len(words) < 2 or any(w.startswith("--") for w in words):
            raise DockerfileError(f"line {step.line}: only COPY <sources...> <destination> is understood")
        found.append((words[:-1], words[-1]))
    return found


def shell_commands(step: Step) -> list[list[str]]:
    """The ``&&``-joined commands of one RUN step, each as argv (quotes removed)."""
    try:
        words = shlex.split(step.args)
    except ValueError as exc:
        raise DockerfileError(f"line {step.line}: {exc}") from exc
    commands: list[list[str]] = [[]]
    for word in words:
        if word == "&&":
            commands.append([])
        elif re.fullmatch(r"[;|&<>]+|\d?>.*", word):
            raise DockerfileError(f"line {step.line}: shell operator {word!r}: join RUN commands with && only")
        else:
            commands[-1].append(word)
    return [argv for argv in commands if argv]


def is_smoke(argv: list[str]) -> bool:
    """A smoke line: ``python -c "import ..."`` (or python3)."""
    return len(argv) == 3 and argv[0] in ("python", "python3") and argv[1] == "-c"


def smoke_lines(path: Path) -> list[tuple[list[str], str]]:
    """(argv, WORKDIR it runs in) of every smoke line of the Dockerfile, in order."""
    found, workdir = [], "/"
    for step in instructions(path):
        if step.op == "WORKDIR":
            workdir = step.args
        elif step.op == "RUN":
            found += [(argv, workdir) for argv in shell_commands(step) if is_smoke(argv)]
    return found


def imported_modules(code: str) -> list[str]:
    """The modules a smoke program ``import a, b.c as d; ...`` names, in order."""
    names = []
    for statement in (s.strip() for s in code.split(";")):
        if statement.startswith("import "):
            names += [part.split(" as ")[0].strip() for part in statement[len("import ") :].split(",")]
        elif statement.startswith("from "):
            names.append(statement.split()[1])
    return names


def start_command(steps: list[Step]) -> list[str]:
    """ENTRYPOINT + CMD (exec form only)."""
    parts: dict[str, list[str]] = {}
    for step in (s for s in steps if s.op in ("CMD", "ENTRYPOINT")):
        if not step.args.startswith("["):
            raise DockerfileError(f'line {step.line}: write {step.op} in exec form, ["..."]')
        parts[step.op] = json.loads(step.args)
    return parts.get("ENTRYPOINT", []) + parts.get("CMD", [])


def dockerignore_keeps(patterns: list[str], path: str) -> bool:
    """Whether BuildKit sends ``path`` (relative, /-separated): the last matching pattern wins,
    and a pattern that matches a folder matches everything under it."""
    keep = True
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negated, glob = pattern.startswith("!"), pattern.lstrip("!").rstrip("/")
        regex = re.escape(glob).replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            keep = negated
    return keep


def dockerignore_patterns(dockerfile: Path) -> list[str]:
    """The patterns of ``<Dockerfile>.dockerignore`` (BuildKit reads it beside the Dockerfile)."""
    lines = (line.strip() for line in Path(f"{dockerfile}.dockerignore").read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


# ---------------------------------------------------------------------------------------------
# Turning an image's RUN commands into commands on this machine


@dataclass
class Image:
    """One Dockerfile, run in ``root`` (the folder standing for the image's ``/``)."""

    role: str
    dockerfile: Path
    root: Path
    steps: list[Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.steps = instructions(self.dockerfile)

    def image_paths(self) -> list[str]:
        """Absolute paths the Dockerfile names: COPY destinations, WORKDIRs, ENV values (longest first)."""
        paths = {dest for _, dest in copies(self.steps) if dest.startswith("/")}
        paths |= {s.args for s in self.steps if s.op == "WORKDIR"}
        paths |= {p for _, value in env_assignments(self.steps) for p in value.split(":") if p.startswith("/")}
        return sorted(paths - {"/"}, key=len, reverse=True)

    def on_host(self, text: str) -> str:
        """``text`` with every image path replaced by its place under ``root`` (one pass)."""
        paths = "|".join(re.escape(path) for path in self.image_paths())
        return re.sub(rf"(?<![\w./-])(?:{paths})(?![\w.-])", lambda m: str(self.root) + m.group(0), text)

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` (no PYTHONPATH) + the ARG defaults + the ENV values (image paths moved under root).

        PIP_NO_CACHE_DIR is dropped so that pip's cache is reused."""
        env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(build_args(self.steps))
        for name, value in env_assignments(self.steps):
            env[name] = self.on_host(expand(value, env))
        env.pop("PIP_NO_CACHE_DIR", None)
        return env


@dataclass(frozen=True)
class Command:
    argv: list[str]
    cwd: str
    note: str = ""
    """Why the command differs from the Dockerfile's (empty: as written, image paths aside)."""


def plan(image: Image, wheel: Path, torch_spec: str, torch_index: str = "") -> list[Command | str]:
    """The Dockerfile's RUN commands (then its CMD) as this machine runs them; a str is a skipped command."""
    variables, workdir, out = build_args(image.steps), "/", []
    for step in image.steps:
        if step.op == "ENV":
            variables.update({name: expand(value, variables) for name, value in env_assignments([step])})
        elif step.op == "WORKDIR":
            workdir = step.args
        elif step.op == "RUN":
            for argv in shell_commands(step):
                out.append(
                    _command(image, [expand(a, variables) for a in argv], workdir, wheel, torch_spec, torch_index)
                )
    out.append(Command(start_command(image.steps), str(image.root) + workdir, "the image's CMD"))
    return out


def _command(image: Image, argv: list[str], workdir: str, wheel: Path, spec: str, index: str) -> Command | str:
    if argv[0] in SKIPPED_COMMANDS:
        return f"skipped ({SKIPPED_COMMANDS[argv[0]]}): {shlex.join(argv)}"
    argv, note = [image.on_host(a) for a in argv], ""
    if argv[:2] in (["pip", "install"], ["pip3", "install"]):
        argv, note = _rewrite_install(argv, wheel, spec, index)
    return Command(argv, str(image.root) + workdir, note)


def _rewrite_install(argv: list[str], wheel: Path, spec: str, index: str) -> tuple[list[str], str]:
    """The source install -> the wheel (same extras); a torch install -> ``spec`` from ``index``."""
    matches = [SOURCE_INSTALL.match(a) for a in argv]
    if any(matches):
        wheels = [f"{wheel}{m.group(1) or ''}" if m else a for a, m in zip(argv, matches, strict=True)]
        return wheels, "the wheel, not the source"
    if not any(re.match(r"torch\W", a) for a in argv):
        return argv, ""
    kept = [a for i, a in enumerate(argv) if "--index-url" not in (a, argv[i - 1] if i else "")]
    swapped = [spec if re.match(r"torch\W", a) else a for a in kept] + (["--index-url", index] if index else [])
    return swapped, f"CPU torch ({spec}) instead of: {shlex.join(argv[2:])}"


# ---------------------------------------------------------------------------------------------
# Running it


_held = threading.local()
"""The lines of the image built on this thread (:func:`build_images`), printed together when it is done."""


def log(message: str) -> None:
    lines = getattr(_held, "lines", None)
    if lines is None:
        print(message, flush=True)
    else:
        lines.append(message)


def run(
    argv: list[str], *, env: dict[str, str], cwd: str | Path, what: str, stdin: str | None = None, shown: str = ""
) -> str:
    """Run ``argv`` (printed first); its stdout, or CheckFailed naming ``what`` with the output's tail.

    With VIRTUAL_ENV in ``env`` (an image's), the program must come from that venv (but for creating it):
    nothing of this machine's own Python may stand in for the image's, nor be installed into."""
    shown = shown or shlex.join(argv)
    log(f"  $ {shown if len(shown) < 400 else shown[:400] + ' ...'}")
    program, started = shutil.which(argv[0], path=env.get("PATH")) or argv[0], time.monotonic()
    venv = env.get("VIRTUAL_ENV")
    if venv and argv[1:3] != ["-m", "venv"] and not program.startswith(venv + os.sep):
        raise CheckFailed(f"{what}: {argv[0]} is {program}, not from the image's venv {venv}: not run")
    try:
        result = subprocess.run(
            [program, *argv[1:]], env=env, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=900
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckFailed(f"{what}: {exc}") from exc
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-3000:]
        raise CheckFailed(f"{what}: exit {result.returncode}: {shown[:300]}\n{tail}")
    if time.monotonic() - started > 5:
        log(f"    ({time.monotonic() - started:.0f} s)")
    return result.stdout


def build_context(dockerfile: Path, destination: Path) -> Path:
    """The files the Dockerfile COPYs into its source folder (relative destinations), as BuildKit
    sends them (the checkout's files, filtered by the .dockerignore), copied to ``destination``."""
    patterns = dockerignore_patterns(dockerfile)
    sources = [src for srcs, dest in copies(instructions(dockerfile)) if not dest.startswith("/") for src in srcs]
    copied = [n for n in checkout_files() if any(n == s or n.startswith(s.rstrip("/") + "/") for s in sources)]
    for name in (n for n in copied if dockerignore_keeps(patterns, n)):
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, destination / name, follow_symlinks=False)
    return destination


def checkout_files() -> list[str]:
    """What a fresh clone holds (tracked, and untracked files git does not ignore): files, and symlinks
    as links (Docker's COPY keeps a link a link; the top-level trainer/, ... link into llmft/)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [name for name in listed if (REPO_ROOT / name).is_file() or (REPO_ROOT / name).is_symlink()]


def build_wheel(context: Path, out: Path) -> Path:
    """``pip wheel --no-deps`` of the build context (setuptools of the running interpreter)."""
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(context)],
        env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
        cwd=out.parent,
        what="building the wheel",
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def build_image(image: Image, wheel: Path, args: argparse.Namespace) -> dict[str, str]:
    """Run the Dockerfile's commands; the environment its containers run with."""
    log(f"== {image.role}: {image.dockerfile.relative_to(REPO_ROOT)} in {image.root}")
    image.root.mkdir(parents=True)
    for sources, dest in copies(image.steps):
        if dest.startswith("/"):  # files the RUN steps read (the constraints); the sources go in as the wheel
            (src,) = sources
            target = Path(image.on_host(dest))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / src, target)
    for workdir in (s.args for s in image.steps if s.op == "WORKDIR"):
        Path(image.on_host(workdir)).mkdir(parents=True, exist_ok=True)
    env = image.environment(dict(os.environ))
    for command in plan(image, wheel, args.torch_spec, args.torch_index):
        if isinstance(command, str):
            log(f"  {command}")
            continue
        if command.note:
            log(f"  ({command.note})")
        run(command.argv, env=env, cwd=command.cwd, what=f"{image.dockerfile.name}")
    return env


def build_one(role: str, dockerfile: str, work: Path, args: argparse.Namespace) -> tuple[list[str], dict | Exception]:
    """One image (its context, wheel and RUN commands), its log held back: (lines, its environment or the error)."""
    _held.lines = []
    try:
        image = Image(role, REPO_ROOT / dockerfile, work / role)
        context = build_context(image.dockerfile, work / f"context-{role}")
        (work / f"dist-{role}").mkdir()
        return _held.lines, build_image(image, build_wheel(context, work / f"dist-{role}"), args)
    except (CheckFailed, DockerfileError) as exc:
        return _held.lines, exc
    finally:
        _held.lines = None


def build_images(dockerfiles: dict[str, str], work: Path, args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Every image at once, each image's log printed whole, in order; the first failure raised. pip's installs wait
    on the disk and the index as well as the CPU: on the 2-core CI machine both builds took 106 s side by side in a
    fresh-clone CI run (152 s with other work on the machine), where one after the other they took about 170 s in
    the CI run before (CONTRIBUTING.md, "How long CI takes")."""
    log(f"== building {', '.join(dockerfiles)} side by side (each log printed when its build is done)")
    started = time.monotonic()
    with ThreadPoolExecutor(len(dockerfiles)) as pool:
        built = {role: pool.submit(build_one, role, path, work, args) for role, path in dockerfiles.items()}
        results = {role: future.result() for role, future in built.items()}
    envs = {}
    for role, (lines, outcome) in results.items():
        for line in lines:
            log(line)
        if isinstance(outcome, Exception):
            raise outcome
        envs[role] = outcome
    log(f"== images built in {time.monotonic() - started:.0f} s")
    return envs


EXECUTOR_PROBE = r"""
import ast, importlib, json, os, sys, tempfile
from kfp.dsl import executor_main, utils  # the module the compiled command runs: python3 -m kfp.dsl.executor_main
for program, name in json.loads(sys.stdin.read()):
    directory = tempfile.mkdtemp()
    with open(os.path.join(directory, "ephemeral_component.py"), "w") as fh:
        fh.write(program)
    module = utils.load_module(module_name="ephemeral_component", module_directory=directory)
    assert callable(getattr(module, name)), name
    (function,) = [n for n in ast.parse(program).body if isinstance(n, ast.FunctionDef) and n.name == name]
    loaded = []
    for node in ast.walk(function):
        if isinstance(node, ast.Import):
            loaded += [importlib.import_module(a.name).__name__ for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(source, alias.name):
                    importlib.import_module(node.module + "." + alias.name)
                loaded.append(node.module + "." + alias.name)
    print(name + ": " + ", ".join(x for x in loaded if x.startswith("llmft")))
"""
"""Run by the image's python3: for each (compiled program, function), what executor_main does before it
calls the function (write the program to a file, utils.load_module, getattr), then every import in the
function's body. Prints the project imports it resolved."""


def compiled_executors(pipeline_env: dict[str, str], out: Path) -> dict[str, list[tuple[str, str, str]]]:
    """image reference -> (task, program, function) of every executor of both compiled pipelines."""
    import yaml

    found: dict[str, list[tuple[str, str, str]]] = {}
    for flags in ([], ["--hpo"]):
        path = out / f"pipeline{'-hpo' if flags else ''}.yaml"
        run(["llmft", "pipeline", "compile", *flags, "--output", str(path)], env=pipeline_env, cwd=out, what="compile")
        spec = next(yaml.safe_load_all(path.read_text()))
        for task, executor in spec["deploymentSpec"]["executors"].items():
            container = executor["container"]
            command, args = container["command"], container["args"]
            script = command[2] if command[:2] == ["sh", "-ec"] and len(command) == 4 else ""
            if "python3 -m kfp.dsl.executor_main" not in script or "pip install" in script:
                raise CheckFailed(f"{path.name}: {task} does not start the KFP executor as a lightweight component")
            entry = (task, command[3], args[args.index("--function_to_execute") + 1])
            if entry[1:] not in [e[1:] for e in found.get(container["image"], [])]:
                found.setdefault(container["image"], []).append(entry)
    return found


def job_containers(pipeline_env: dict[str, str], out: Path) -> list[tuple[str, str, list[str]]]:
    """(job kind, image, command + args) of every container of the job each training backend renders
    (llmft/components/lib/jobs/backends.py: the PyTorchJob and the TrainJob)."""
    import yaml

    from llmft.components.lib.jobs.backends import render_names

    found = []
    for backend in sorted(render_names()):
        path = out / f"{backend}.yaml"
        argv = ["llmft", "pipeline", "render-job", "--backend", backend, "--output", str(path), PLACEHOLDER_MLFLOW]
        run(argv, env=pipeline_env, cwd=out, what="render-job")
        text = path.read_text()
        config_path, config = rendered_config(text)
        local_config = out / f"{backend}-config.yaml"  # the plan step writes it on the volume; here beside the job
        local_config.write_text(config)
        stack = [yaml.safe_load(text)]
        while stack:
            node = stack.pop()
            if isinstance(node, dict) and "image" in node and "command" in node:
                command = list(node["command"]) + list(node.get("args", []))
                command = [str(local_config) if word == config_path else word for word in command]
                found.append((backend, node["image"], command))
            stack += list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else []
    return found


def rendered_config(text: str) -> tuple[str, str]:
    """(path, YAML) of the config.yaml that a render-job header shows (``#   <path>:`` then the YAML,
    each line indented by ``#   ``), which the job's ``llmft train --config <path>`` reads."""
    lines = [line[len("#   ") :] for line in text.splitlines() if line.startswith("#   ")]
    if not lines or not lines[0].endswith(":"):
        raise SystemExit("error: image check failed: the render-job header shows no config.yaml")
    return lines[0][:-1], "\n".join(lines[1:]) + "\n"


def check_containers(envs: dict[str, dict[str, str]], out: Path) -> None:
    """Run what the compiled pipelines and the job manifests start in each image."""
    from llmft.components import images

    role_of = images.dockerfile_roles()
    log("== what the pipeline and the jobs start in the images")
    trainer, pipeline = envs["trainer"], envs["pipeline"]
    run(["llmft", "train", "--help"], env=trainer, cwd=out, what="trainer image: llmft train --help")
    for image, entries in compiled_executors(pipeline, out).items():
        env = {**envs[role_of[image]], "_KFP_RUNTIME": "true"}  # as the compiled command sets it
        log(f"  {role_of[image]} image: {', '.join(task for task, _, _ in entries)}")
        probe = json.dumps([[program, function] for _, program, function in entries])
        what = f"{role_of[image]} image: the components' entry points"
        shown = f'_KFP_RUNTIME=true python3 -c "$EXECUTOR_PROBE"  # {len(entries)} compiled components on stdin'
        loaded = run(["python3", "-c", EXECUTOR_PROBE], env=env, cwd=out, what=what, stdin=probe, shown=shown)
        log("    " + loaded.strip().replace("\n", "\n    "))
    for kind, image, argv in job_containers(pipeline, out):
        check = ["--print-config"] if argv[:2] == ["llmft", "train"] else ["--help"]
        run(argv + check, env=envs[role_of[image]], cwd=out, what=f"{kind} container in the {role_of[image]} image")


MEMORY_TMP = Path("/dev/shm")
MEMORY_TMP_FREE = 10 << 30
"""The venvs take about 4 GB. In memory when there is room: on a disk mounted with ``discard`` (this project's
CI machine) deleting them took minutes, longer than installing them."""


def work_folder(given: str | None) -> Path:
    """``given`` (kept afterwards) or a new temporary folder (removed afterwards), outside the checkout."""
    if given:
        return Path(given).resolve()
    in_memory = MEMORY_TMP.is_dir() and shutil.disk_usage(MEMORY_TMP).free >= MEMORY_TMP_FREE
    in_memory = in_memory and not os.statvfs(MEMORY_TMP).f_flag & os.ST_NOEXEC  # the venvs' scripts must run
    return Path(tempfile.mkdtemp(prefix="llmft-image-check-", dir=MEMORY_TMP if in_memory else None)).resolve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch-spec", default="torch==2.13.0", help="torch for the trainer image (make: TORCH_SPEC)")
    parser.add_argument("--torch-index", default="", help="index URL of that torch (make: TORCH_INDEX)")
    parser.add_argument("--work", help="an empty folder outside the checkout, kept (default: a temporary one)")
    args = parser.parse_args(argv)
    from llmft.components.images import DOCKERFILES

    work = work_folder(args.work)
    if work.is_relative_to(REPO_ROOT) or (args.work and work.exists() and any(work.iterdir())):
        parser.error(f"--work {work}: give an empty folder outside the checkout")
    started = time.monotonic()
    try:
        work.mkdir(parents=True, exist_ok=True)
        envs = build_images({role: dockerfile for role, (dockerfile, _, _) in DOCKERFILES.items()}, work, args)
        (work / "out").mkdir()
        check_containers(envs, work / "out")
        check_pipelines(envs, work / "pipelines", run=run, log=log)
        log(f"image check passed in {time.monotonic() - started:.0f} s")
        return 0
    except (CheckFailed, DockerfileError, PipelineCheckFailed) as exc:
        print(f"error: image check failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.work:
            log(f"removing {work}")
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
