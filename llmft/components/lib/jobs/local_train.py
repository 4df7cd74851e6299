"""The `local` training backend: the same trainer, launched as subprocesses of the train step.

Used by ``llmft pipeline run-local`` (kfp.local); the plan step refuses it on a cluster. The
command is exactly what a PyTorchJob replica runs, ``llmft train --nproc N key=value ...``
(``python -m llmft train``): the one launcher, which forwards SIGTERM to torchrun's ranks and
exits 143 once they committed a checkpoint. So the two backends differ in where the processes
run and nothing else.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from llmft.components.images import local_trainer_python
from llmft.components.lib.jobs.pytorchjob_spec import JobSpec, trainer_command
from llmft.katib.metrics import parse_metric_lines, summarize
from llmft.trainer.errors import EXIT_CODE_MEANINGS, LlmftError

LOG_TAIL_LINES = 40
METRICS = ("eval_loss", "perplexity")


class TrainingFailed(LlmftError):
    """The training processes exited non-zero; the message carries their last log lines."""


class TrainingStopped(LlmftError):
    """This step was sent SIGTERM (run-local stopped): it was forwarded to the trainer, which committed a checkpoint
    and exited; the step exits 143 (128 + SIGTERM)."""

    exit_code = 143


ERROR_LINE = re.compile(r"^error(?: \(exit \d+\))?: (.+)$")


def trainer_error(lines) -> str:
    """The trainer's own one-line reason (its last ``error:`` line), or ''."""
    found = [m.group(1) for m in map(ERROR_LINE.match, (line.strip() for line in lines)) if m]
    return found[-1] if found else ""


def _forward_sigterm(process: subprocess.Popen, received: list[int]):
    """SIGTERM to this step goes on to the trainer (which commits a checkpoint and exits 143); returns the previous
    handler, None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def forward(signum, _frame):
        received.append(signum)
        if process.poll() is None:
            process.send_signal(signum)

    return signal.signal(signal.SIGTERM, forward)


def train_command(launch, *, nproc: int = 1) -> list[str]:
    """``python -m llmft train --nproc N --config <config.yaml> key=value ...``: the command of a
    PyTorchJob replica (``launch``, a TrainerLaunch), run here."""
    if nproc < 1:
        raise LlmftError(f"nproc must be >= 1, got {nproc}")
    spec = JobSpec(name="local", config_path=launch.config_path, overrides=launch.overrides, nproc_per_node=str(nproc))
    command, args = trainer_command(spec)
    return [local_trainer_python(), "-m", *command, *args]


def run_local_training(
    launch,
    *,
    nproc: int = 1,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> dict[str, float]:
    """Run the trainer; stream its output; return the last eval metrics it printed.

    On ``timeout_s`` the launcher gets SIGTERM (the trainer commits a checkpoint and exits 143).
    Raises :class:`TrainingFailed` with the exit code and the last log lines on failure.
    """

    command = train_command(launch, nproc=nproc)
    print("training: " + " ".join(command[2:]), flush=True)  # llmft train --nproc N --config ... data=...
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    observations: list[tuple[str, float]] = []
    log = open(log_path, "a", encoding="utf-8") if log_path else None  # noqa: SIM115 - closed below
    watchdog = previous = None
    received: list[int] = []
    try:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        previous = _forward_sigterm(process, received)
        if timeout_s:
            watchdog = threading.Timer(timeout_s, process.terminate)
            watchdog.start()
        assert process.stdout is not None  # stdout=PIPE
        for line in process.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))
            if log:
                log.write(line)
                log.flush()  # train.log follows the trainer line by line
            observations += parse_metric_lines([line], METRICS)
        code = process.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if watchdog is not None:
            watchdog.cancel()
        if log:
            log.close()
    if received:
        meaning = EXIT_CODE_MEANINGS.get(code, f"exit {code}")
        raise TrainingStopped(f"stopped by SIGTERM: forwarded to the trainer, which exited {code} ({meaning})")
    if code != 0:
        reason = trainer_error(tail) or f"exit {code}, {EXIT_CODE_MEANINGS.get(code, 'see the log lines below')}"
        raise TrainingFailed(
            f"local training failed: {reason} ({' '.join(command[1:6])} ...). Last log lines:\n" + "\n".join(tail)
        )
    return summarize(observations, {name: "latest" for name in METRICS})


def run_local_step(plan, launch) -> dict[str, float]:
    """The train step's ``local`` backend (llmft/components/lib/jobs/backends.py): :func:`run_local_training`
    in the plan's run directory, ``train.log`` beside its checkpoints, the plan's MLflow server if it names one."""
    trainer, job = plan.trainer, plan.job
    os.makedirs(trainer.run_dir, exist_ok=True)
    tracking = plan.registry.tracking_uri
    try:
        return run_local_training(
            launch,
            nproc=max(1, job.num_workers),
            log_path=os.path.join(trainer.run_dir, "train.log"),
            env={"MLFLOW_TRACKING_URI": tracking} if tracking else {},
            timeout_s=job.timeout_s,
        )
    except LlmftError as exc:  # one `error:` line and the contract's code, as the cluster backends' launcher
        print(f"error (exit {exc.exit_code}): {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
