"""Run the pipeline on this machine with kfp.local (``llmft pipeline run-local``): its local form.

``kfp.local.SubprocessRunner(use_venv=False)`` runs each task as a subprocess of this
Python, so the tasks import the installed package exactly as the component image would.
Kubernetes settings (PVC, Secrets, node selectors) are ignored locally; the work folder
stands in for the volume (see :mod:`llmft.pipelines.defaults`).

Everything the tasks print goes to ``<work>/run-local.log``; the screen shows one line
per task and, at the end, the summary of :mod:`llmft.components.lib.summary` (or, when a task
failed, its name and the last lines of its log).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmft.components.lib.summary import collect_run_facts, latest_run_dir, render_summary
from llmft.pipelines.defaults import resolve_local_arguments
from llmft.trainer.mlflow_settings import redact_credentials

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STARTED = re.compile(r"Executing task '([^']+)'")
FINISHED = re.compile(r"Task '([^']+)' finished with status (\w+)")
FAILED_TASK = re.compile(r"Inner task failed: '([^']+)'")
TAIL_LINES = 25


class ProgressStream(io.TextIOBase):
    """stdout replacement: every line to the log file; progress lines (or all, verbose) to the screen."""

    def __init__(self, log, screen, *, verbose: bool = False):
        self.log, self.screen, self.verbose = log, screen, verbose
        self.buffer = ""
        self.current: str | None = None
        self.started_at = 0.0
        self.task_lines: dict[str, deque[str]] = {}
        self.statuses: dict[str, str] = {}

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        shown = redact_credentials(text)  # kfp.local dumps each task's inputs: a URL's password never lands here
        self.log.write(shown)
        self.buffer += shown
        while "\n" in self.buffer:
            line, self.buffer = self.buffer.split("\n", 1)
            self._line(ANSI.sub("", line))
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.screen.flush()

    def _line(self, line: str) -> None:
        if self.verbose:
            self.screen.write(line + "\n")
        started, finished = STARTED.search(line), FINISHED.search(line)
        if started:
            self.current, self.started_at = started.group(1), time.perf_counter()
            self.task_lines[self.current] = deque(maxlen=TAIL_LINES)
            if not self.verbose and _isatty(self.screen):
                self.screen.write(f"  {self.current:<26} running ...\r")
        elif finished:
            name, status = finished.groups()
            self.statuses[name] = status
            if not self.verbose:
                self.screen.write(f"  {name:<26} {status:<8} {time.perf_counter() - self.started_at:6.1f} s\n")
            self.current = None
        elif self.current and line.strip():
            self.task_lines[self.current].append(line.strip())
        self.screen.flush()


@dataclass
class LocalOutcome:
    """What a local run produced."""

    succeeded: bool
    arguments: dict[str, Any]
    log_path: Path
    pipeline_name: str = "llm-finetune"
    run_dir: Path | None = None
    failed_task: str | None = None
    failure_tail: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def render(self, elapsed_s: float) -> str:
        if self.succeeded:
            return render_summary(self.facts, elapsed_s=elapsed_s, pipeline_name=self.pipeline_name)
        lines = [f"pipeline FAILED after {elapsed_s:.0f} s in task {self.failed_task or '?'}; its last log lines:"]
        lines += [f"  | {line}" for line in without_traceback(self.failure_tail)[-SHOWN_TAIL_LINES:]]
        lines.append(f"full log: {self.log_path}")
        if self.run_dir:
            lines.append(f"artifacts of the finished tasks: {self.run_dir}")
        return "\n".join(lines)

    def failure_line(self) -> str:
        """One line for stderr: the failed task and its own error (the exception a component raised, or the
        ``error:`` line a command printed), never a traceback."""
        cause = next((m.group(1) for m in map(CAUSE.match, reversed(self.failure_tail)) if m), "")
        cause = cause or "see its log lines above"
        return f"pipeline task {self.failed_task or '?'} failed: {cause} (full log: {self.log_path})"


CAUSE = re.compile(r"^(?:error: |(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Stop|Interrupt)\w*: )(.+)$")
"""The line that says why a task failed: a command's ``error: ...`` or a raised exception's last line."""
SHOWN_TAIL_LINES = 12


def without_traceback(lines: list[str]) -> list[str]:
    """``lines`` without Python traceback blocks (``Traceback ...`` up to, not including, the exception's line)."""
    kept, inside = [], False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            inside = True
        elif inside and CAUSE.match(line):
            inside = False
        if not inside:
            kept.append(line)
    return kept


def prepare_local_mlflow(tracking_uri: str, experiment: str, artifact_root: Path) -> None:
    """For a SQLite store, create the experiment with its artifacts in the work folder
    (instead of ./mlruns in whatever directory the tasks run from)."""
    if not tracking_uri.startswith("sqlite:"):
        return
    # heavy: mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    if client.get_experiment_by_name(experiment) is None:
        artifact_root.mkdir(parents=True, exist_ok=True)
        client.create_experiment(experiment, artifact_location=artifact_root.resolve().as_uri())


def run_pipeline_locally(
    overrides: dict[str, Any],
    *,
    work_dir: str | Path,
    verbose: bool = False,
    hpo: bool = False,
    extra_defaults: dict[str, Any] | None = None,
) -> LocalOutcome:
    """Run the pipeline (the HPO one with ``hpo``) through kfp.local with the local defaults (plus
    ``extra_defaults``, then ``overrides``; older parameter names accepted): its kfp.local form, which retries
    nothing (``local_pipeline``), built with these arguments as its values (the compile-time ones too); never
    raises for a failed task (see the outcome)."""
    # heavy: kfp
    from kfp import local

    # heavy: kfp, kubeflow_katib_api, pydantic
    from llmft.pipelines.llm_finetune import local_pipeline

    work = Path(work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder {work}: preparing the base model and MLflow store ...", flush=True)
    arguments = resolve_local_arguments(overrides, work, extra_defaults)
    pipeline = local_pipeline(hpo=hpo, defaults=arguments)
    prepare_local_mlflow(arguments["mlflow_tracking_uri"], arguments["mlflow_experiment"], work / "mlartifacts")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Tiny matrices on a small shared CPU: one intra-op thread per process is many times faster
    # than threads spin-waiting on each other (measured 12x on this 2-core machine under load).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    pipeline_root = work / "kfp"
    local.init(local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root))
    log_path = work / "run-local.log"
    outcome = LocalOutcome(succeeded=False, arguments=arguments, log_path=log_path, pipeline_name=pipeline.name)
    with open(log_path, "a", encoding="utf-8") as log, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*non-Python base image.*")
        warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
        stream = ProgressStream(log, _screen(), verbose=verbose)
        try:
            with contextlib.redirect_stdout(stream):
                pipeline()  # every value is the local form's compiled default
            outcome.succeeded = True
        except RuntimeError as exc:
            failed = FAILED_TASK.search(ANSI.sub("", str(exc)))
            outcome.failed_task = failed.group(1) if failed else None
            outcome.failure_tail = list(stream.task_lines.get(outcome.failed_task or "", []))
            log.write(f"\n{redact_credentials(str(exc))}\n")
    outcome.run_dir = latest_run_dir(pipeline_root, pipeline.name)
    if outcome.run_dir is not None:
        outcome.facts = collect_run_facts(outcome.run_dir)
    return outcome


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _screen():
    return sys.__stdout__ if sys.stdout is None else sys.stdout
