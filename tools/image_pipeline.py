"""Every pipeline step does its work in its own image's environment (`make image-check`, after the images).

tools/image_check.py builds one venv per Dockerfile (the wheel, the image's extras and constraints, its
CPU torch in the trainer image). This module then runs both pipelines through kfp.local on the demo's
inputs, with each task on the Python of the image its component is compiled for: ``base_image`` ->
``components.images.dockerfile_roles()`` -> that Dockerfile's venv. So plan, train, promote, register,
deploy, cleanup and the sweep run without torch (the pipeline image), prepare, tokenize, evaluate and the
serving form with CPU torch (the trainer image); a component that imports what its image lacks fails.

kfp.local's ``SubprocessRunner(use_venv=False)`` runs every task on ``sys.executable``. Here
:class:`ImageTaskHandler` (a ``SubprocessTaskHandler``) puts the image's interpreter in the task's command
the way ``use_venv=True`` puts its venv's (``replace_python_executable``), and starts it with the image's
environment, outside the checkout, with ``PYTHONSAFEPATH=1``: the installed wheel is what the task imports.
The trainer processes the local backends start where a cluster starts trainer-image pods (``llmft train``
of ``training_backend=local``, the trials of ``hpo_backend=local``) get the trainer image's Python
(LLMFT_LOCAL_TRAINER_PYTHON, llmft/components/images.py).

Cases (:data:`CASES`): the pipeline with the model as a directory on the volume (the plan step's
torch-free volume estimate reads its config.json), and the HPO pipeline (its sweep step) with the model as
a hub id in the volume's hub cache (HF_HOME, filled offline), then ``llmft pipeline render-job --hpo`` for
both backends in the pipeline image with that hub id (image_check renders the base pipeline's jobs). The
demo's inputs, fewer steps.

Not covered: ``serving_deploy_mode=local`` (it loads the model with transformers: a stand-in for KServe's runtime,
whose image is KServe's), so the runs use ``serving_deploy=false`` (the deploy step writes and checks the
InferenceService manifest); kfp.local ignores the Kubernetes settings (PVC, Secrets, resources).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmft.components.images import LOCAL_TRAINER_PYTHON_ENV, dockerfile_roles
from llmft.components.lib.contracts.schema import DATA_MOUNT
from llmft.components.lib.jobs.backends import render_names

REPO_ROOT = Path(__file__).resolve().parents[1]
HUB_ID = "llmft-ci/tiny-chat"
HUB_COMMIT = "c" * 40
"""The hub id (and snapshot) the tiny model is cached under on the volume for the hub-id case."""
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
"""This process's variables a task never inherits (the image's environment sets its own venv)."""
PLACEHOLDER_MLFLOW = "mlflow_tracking_uri=http://mlflow.invalid:5000"
"""render-job refuses to render without an MLflow server; any URL does (nothing is contacted)."""
FAST_TRAINING = {
    "finetune_save_every": 4,
    "finetune_eval_every": 4,
    "finetune_batch_size": 4,
    "finetune_overrides": "log_every=4 keep_last=2 observe.progress_bar=false",
}


class PipelineCheckFailed(RuntimeError):
    """A pipeline step failed in its image's environment."""


@dataclass(frozen=True)
class Case:
    """One run of a pipeline in the images."""

    name: str
    hpo: bool
    hub: bool
    """The model as a hub id in the volume's hub cache (else: the tiny model's directory on the volume)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    render: bool = False
    """Then ``llmft pipeline render-job`` for both backends in the pipeline image, with this case's model."""


CASES = (
    Case("model-directory", hpo=False, hub=False, overrides={"finetune_max_steps": 8, "serving_deploy": False}),
    Case(
        "hub-id-sweep",
        hpo=True,
        hub=True,
        overrides={
            "base_model": HUB_ID,
            "finetune_max_steps": 8,
            "serving_deploy": False,
            "hpo_max_trials": 1,  # one trial runs the sweep step and its trainer process; more add time only
            "hpo_trial_overrides": (
                "max_steps=2 eval_every=2 log_every=2 batch.global_sequences=4 eval.max_sequences=8 "
                "observe.progress_bar=false observe.tensorboard=false"
            ),
        },
        render=True,  # image_check renders both backends already (the base pipeline): here the HPO one
    ),
)


# ---------------------------------------------------------------------------------------------
# Which Python a task gets (pure)


def task_interpreter(image: str, roles: Mapping[str, str], envs: Mapping[str, Mapping[str, str]]) -> str:
    """The python3 of the venv of the Dockerfile that builds ``image`` (a component's base image)."""
    role = roles.get(image)
    if role is None or role not in envs:
        raise PipelineCheckFailed(
            f"base image {image} is built by no Dockerfile of llmft/components/images.py DOCKERFILES"
        )
    return str(Path(envs[role]["VIRTUAL_ENV"]) / "bin" / "python3")


def task_environment(
    ours: Mapping[str, str], image_env: Mapping[str, str], task_env: Mapping[str, str], trainer_python: str
) -> dict[str, str]:
    """A task's environment: this process's (what the run set, e.g. OMP_NUM_THREADS) without its Python
    paths, under the image's (its venv first on PATH), under the task's own (set_env_variable); the
    working directory never on sys.path; the local backends' trainer processes on the trainer image."""
    kept = {k: v for k, v in ours.items() if k not in DROPPED_ENV}
    return {**kept, **image_env, **task_env, "PYTHONSAFEPATH": "1", LOCAL_TRAINER_PYTHON_ENV: trainer_python}


def function_of(command: list[str]) -> str:
    """The component function a compiled executor command runs (``--function_to_execute NAME``)."""
    return command[command.index("--function_to_execute") + 1] if "--function_to_execute" in command else "?"


# ---------------------------------------------------------------------------------------------
# The task handler


@dataclass
class TaskRecord:
    function: str
    image: str
    python: str
    exit_code: int


def image_task_handler(envs: Mapping[str, Mapping[str, str]], cwd: Path, record: list[TaskRecord]) -> type:
    """A kfp.local SubprocessTaskHandler that runs each task on its image's Python (see the module doc)."""
    # heavy: kfp
    from kfp.local import status, subprocess_task_handler

    roles = dockerfile_roles()
    trainer_python = task_interpreter(next(i for i, r in roles.items() if r == "trainer"), roles, envs)

    class ImageTaskHandler(subprocess_task_handler.SubprocessTaskHandler):
        def run(self) -> status.Status:
            python = task_interpreter(self.image, roles, envs)
            env = task_environment(os.environ, envs[roles[self.image]], self.env_vars, trainer_python)
            command = subprocess_task_handler.replace_python_executable(self.full_command, python)
            code = stream(command, env=env, cwd=cwd)
            record.append(TaskRecord(function_of(self.full_command), self.image, python, code))
            return status.Status.SUCCESS if code == 0 else status.Status.FAILURE

    return ImageTaskHandler


def stream(command: list[str], *, env: Mapping[str, str], cwd: Path) -> int:
    """Run ``command``; its output line by line to stdout (kfp.local's run_local_subprocess, with env and cwd)."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=dict(env), cwd=cwd
    ) as process:
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            print(line, end="")
        print()
        return process.wait()


@contextlib.contextmanager
def tasks_in_images(handler: type) -> Iterator[None]:
    """kfp.local runs lightweight tasks with ``handler``. kfp 2.17.3 kfp/local/task_dispatcher.py
    (run_single_task_implementation, lines 180-194) looks ``subprocess_task_handler.SubprocessTaskHandler``
    up for every task it runs, so the module attribute is replaced while the run lasts."""
    # heavy: kfp
    from kfp.local import subprocess_task_handler

    original = subprocess_task_handler.SubprocessTaskHandler
    subprocess_task_handler.SubprocessTaskHandler = handler
    try:
        yield
    finally:
        subprocess_task_handler.SubprocessTaskHandler = original


# ---------------------------------------------------------------------------------------------
# The inputs


def hub_cache(hub_root: Path, model_dir: Path, hub_id: str = HUB_ID, commit: str = HUB_COMMIT) -> Path:
    """``model_dir`` as ``hub_id`` in the huggingface_hub cache layout under ``hub_root`` (HF_HUB_CACHE):
    ``models--<org>--<name>/snapshots/<commit>`` with ``refs/main`` naming it. Returns the snapshot."""
    repo = hub_root / f"models--{hub_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        shutil.copytree(model_dir, snapshot, symlinks=False)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def prepare_volume(case: Case, data_root: Path) -> None:
    """The hub-id case's cache on the volume, filled offline from the tiny model."""
    if case.hub:
        from llmft.pipelines.defaults import ensure_tiny_model  # heavy: torch, transformers

        built = ensure_tiny_model(data_root.parent / "tiny-model-source")
        hub_cache(data_root / "hf-cache" / "hub", built)


MLFLOW_START_S = 300
"""How long the server may take to answer /health: its first start creates the SQLite store (alembic migrations),
which took over 120 s on the 2-core machine under other work. A wait, not a cost: a healthy server answers sooner."""


@contextlib.contextmanager
def mlflow_server(work: Path) -> Iterator[str]:
    """A real ``mlflow server`` on loopback (this checkout's full mlflow, a SQLite store in ``work``), as a cluster
    has one: the trainer image's client (mlflow-skinny) talks HTTP to a server and cannot open a database store
    itself, so kfp.local's default ``sqlite:///`` URI would test a path no cluster takes."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = work / "mlflow-server.log"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(work / "mlartifacts"), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server, log)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 15)
        server.wait(timeout=30)


def _wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + MLFLOW_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise PipelineCheckFailed(f"mlflow server exited with {server.returncode}: {_tail(log)}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    raise PipelineCheckFailed(f"mlflow server not healthy after {MLFLOW_START_S} s: {_tail(log)}")


def _tail(log: Path, lines: int = 30) -> str:
    """The end of the server's log, in the error itself: the work folder holding the log is removed on failure."""
    text = log.read_text(errors="replace").splitlines()[-lines:] if log.is_file() else ["(no log)"]
    return f"{log}, last lines:\n" + "\n".join(text)


# ---------------------------------------------------------------------------------------------
# Running the cases


Runner = Callable[..., str]
"""tools/image_check.py ``run``: a command in an image's environment, printed; its stdout, or CheckFailed."""


def run_case(case: Case, envs: Mapping[str, Mapping[str, str]], work: Path, run: Runner, log: Callable) -> None:
    """One pipeline run with every task in its image (then render-job for both backends, when the case says so)."""
    from llmft.pipelines.llm_finetune_hpo import HPO_LOCAL_DEFAULTS  # heavy: kfp
    from llmft.pipelines.local_run import run_pipeline_locally  # heavy: kfp

    work.mkdir(parents=True)
    data_root = work / "data"
    prepare_volume(case, data_root)
    defaults = {**(HPO_LOCAL_DEFAULTS if case.hpo else {}), **FAST_TRAINING}
    record: list[TaskRecord] = []
    started = time.monotonic()
    with mlflow_server(work) as tracking_uri, tasks_in_images(image_task_handler(envs, work, record)):
        overrides = {**case.overrides, "mlflow_tracking_uri": tracking_uri}
        outcome = run_pipeline_locally(overrides, work_dir=work, hpo=case.hpo, extra_defaults=defaults)
    for task in record:
        log(f"  {task.function:<32} exit {task.exit_code}  {role_name(task.python, envs)} image ({task.python})")
    if not outcome.succeeded:
        tail = "\n".join(outcome.failure_tail)
        raise PipelineCheckFailed(f"{case.name}: task {outcome.failed_task} failed in its image:\n{tail}")
    check_plan_log(case, outcome.log_path)
    log(f"  {case.name}: {len(record)} tasks in their images, {time.monotonic() - started:.0f} s")
    if case.render:
        render_jobs(case, outcome.arguments, envs["pipeline"], work, run, log)


def role_name(python: str, envs: Mapping[str, Mapping[str, str]]) -> str:
    return next((role for role, env in envs.items() if python.startswith(env["VIRTUAL_ENV"] + os.sep)), "?")


def check_plan_log(case: Case, log_path: Path) -> None:
    """The plan step (pipeline image, no torch) estimated the run's volume footprint from the model's config.json."""
    if "volume: this run writes about" not in log_path.read_text():
        raise PipelineCheckFailed(f"{case.name}: the plan step did not estimate the volume footprint ({log_path})")


def render_jobs(case: Case, arguments: Mapping, env: Mapping[str, str], work: Path, run: Runner, log) -> None:
    """``llmft pipeline render-job`` for every registered backend that renders a job (the registry's
    ``render_names``, as tools/image_check.py reads it) in the pipeline image, with the run's model where a
    cluster has it (the volume mounted at /data, render-job's only volume path; a hub id as it is)."""
    model = str(arguments["base_model"])
    if not case.hub:
        model = DATA_MOUNT + "/" + str(Path(model).relative_to(arguments["volume_path"]))
    for backend in sorted(render_names()):
        output = work / f"render-{backend}.yaml"
        argv = ["llmft", "pipeline", "render-job", "--backend", backend, "--output", str(output)]
        argv += [f"base_model={model}", PLACEHOLDER_MLFLOW, *(["--hpo"] if case.hpo else [])]
        out = run(argv, env=env, cwd=work, what=f"{case.name}: render-job {backend} in the pipeline image")
        log("    " + out.strip())


def check_pipelines(envs: Mapping[str, Mapping[str, str]], work: Path, run: Runner, log: Callable = print) -> None:
    """Every case of :data:`CASES`, each in a folder of its own under ``work``."""
    log("== both pipelines through kfp.local, every task in its image's environment")
    no_torch = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    if subprocess.run([task_interpreter_of(envs, "pipeline"), "-c", no_torch], env=dict(envs["pipeline"])).returncode:
        raise PipelineCheckFailed("the pipeline image's venv has torch: this check would prove nothing")
    for case in CASES:
        what = f"{'HPO pipeline' if case.hpo else 'pipeline'}, model {'hub id' if case.hub else 'directory'}"
        log(f"== {case.name} ({what})")
        run_case(case, envs, work / case.name, run, log)


def task_interpreter_of(envs: Mapping[str, Mapping[str, str]], role: str) -> str:
    return str(Path(envs[role]["VIRTUAL_ENV"]) / "bin" / "python3")
