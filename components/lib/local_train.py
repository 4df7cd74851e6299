"""The `local` training backend: the same trainer, launched with torchrun as subprocesses.

Used by ``llmft pipeline run-local`` (kfp.local) and by single-node clusters without the
Training Operator. The command is exactly what a PyTorchJob replica runs
(``torchrun ... -m llmft.trainer key=value ...``), only with a standalone rendezvous, so the
two backends differ in where the processes run and nothing else.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from llmft.trainer.errors import LlmftError

METRIC_LINE = re.compile(r"^(eval_loss|perplexity)=([+-]?\d*\.?\d+(?:[eE][+-]?\d+)?)\s*$")
LOG_TAIL_LINES = 40


class TrainingFailed(LlmftError):
    """The training processes exited non-zero; the message carries their last log lines."""


def torchrun_command(overrides: list[str], *, nproc: int = 1) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m llmft.trainer <overrides>``."""
    if nproc < 1:
        raise LlmftError(f"nproc must be >= 1, got {nproc}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "llmft.trainer",
        *overrides,
    ]


def run_local_training(
    overrides: list[str],
    *,
    nproc: int = 1,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> dict[str, float]:
    """Run the trainer through torchrun; stream its output; return the last eval metrics printed.

    Raises :class:`TrainingFailed` with the exit code and the last log lines on failure.
    """
    command = torchrun_command(overrides, nproc=nproc)
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    metrics: dict[str, float] = {}
    log = open(log_path, "a", encoding="utf-8") if log_path else None  # noqa: SIM115 - closed below
    watchdog = None
    try:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        if timeout_s:  # SIGTERM: the trainer commits a checkpoint and exits 143
            watchdog = threading.Timer(timeout_s, process.terminate)
            watchdog.start()
        for line in process.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip("\n"))
            if log:
                log.write(line)
            match = METRIC_LINE.match(line.strip())
            if match:
                metrics[match.group(1)] = float(match.group(2))
        code = process.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if log:
            log.close()
    if code != 0:
        raise TrainingFailed(
            f"local training exited with code {code} ({' '.join(command[:6])} ...). Last log lines:\n" + "\n".join(tail)
        )
    return metrics
