"""Run the pipeline on this machine with kfp.local (``llmft pipeline run-local``): its local form.

``kfp.local.SubprocessRunner(use_venv=False)`` runs each task as a subprocess of this
Python, so the tasks import the installed package exactly as the component image would.
Kubernetes settings (PVC, Secrets, node selectors) are ignored locally; the work folder
stands in for the volume (see :mod:`llmft.pipelines.defaults`).

Everything the tasks print goes to ``<work>/run-local.log``; the screen shows one line per task, the
running task's latest ``progress:`` line (the trainer's step/total, tokens/s, loss, elapsed and ETA:
overwritten in place on a terminal, one line each elsewhere) and, at the end, the summary of
:mod:`llmft.components.lib.summary` (or, when a task failed, its one-line reason first, then the last lines of
its log without the traceback). One run per work folder; SIGTERM stops the running task and exits 143
(:mod:`llmft.pipelines.local_stop`).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmft.components.lib.summary import collect_run_facts, latest_run_dir, render_summary
from llmft.pipelines.defaults import resolve_local_arguments
from llmft.pipelines.local_stop import StopForwarder, work_folder_lock
from llmft.trainer.errors import SignalStop
from llmft.trainer.mlflow_settings import redact_credentials
from llmft.trainer.progress import parse_line

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STARTED = re.compile(r"Executing task '([^']+)'")
FINISHED = re.compile(r"Task '([^']+)' finished with status (\w+)")
FAILED_TASK = re.compile(r"Inner task failed: '([^']+)'")
TAIL_LINES = 25


class ProgressStream(io.TextIOBase):
    """stdout replacement: every line to the log file; progress lines (or all, verbose) to the screen."""

    def __init__(self, log, screen, *, verbose: bool = False, stopped=lambda: 0):
        self.log, self.screen, self.verbose, self.stopped = log, screen, verbose, stopped
        self.buffer = ""
        self.current: str | None = None
        self.started_at = 0.0
        self.task_lines: dict[str, deque[str]] = {}
        self.statuses: dict[str, str] = {}
        self.latest_progress = ""

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
        tty = _isatty(self.screen)
        if (started or finished) and (signum := self.stopped()):
            self._end_after_stop(signum, finished.group(1) if finished else None)
        if started:
            self.current, self.started_at = started.group(1), time.perf_counter()
            self.task_lines[self.current] = deque(maxlen=TAIL_LINES)
            if not self.verbose and tty:
                self.screen.write(f"  {self.current:<26} running ...\r")
        elif finished:
            name, status = finished.groups()
            self.statuses[name] = status
            if not self.verbose:
                clear = "\x1b[2K" if tty else ""  # the progress line it overwrites
                self.screen.write(f"{clear}  {name:<26} {status:<8} {time.perf_counter() - self.started_at:6.1f} s\n")
            self.current = None
        elif self.current and line.strip():
            self.task_lines[self.current].append(line.rstrip())
            if not self.verbose and parse_line(line) is not None:
                self._progress(line)
        self.screen.flush()
        self.log.flush()  # run-local.log follows the run line by line (tail -f)

    def _end_after_stop(self, signum: int, finished: str | None) -> None:
        """A stop signal came (local_stop.StopForwarder): once the running task has ended, no other task starts,
        no retry, no exit handler. Raised out of kfp.local's own log call (a BaseException: logging lets it pass)."""
        if finished:
            self.screen.write(f"  {finished:<26} stopped\n")
            self.screen.flush()
        raise SignalStop(signum, f"stopped by {signal.Signals(signum).name}")

    def _progress(self, line: str) -> None:
        """The running task's latest progress line: in place on a terminal, one line each elsewhere."""
        shown = f"  {self.current:<26} {line[line.index('progress: ') + len('progress: ') :].strip()}"
        self.latest_progress = shown.strip()
        if _isatty(self.screen):
            self.screen.write(f"\x1b[2K{shown[: _width(self.screen)]}\r")
        else:
            self.screen.write(shown + "\n")


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
    stopped_by: int = 0
    """The signal that stopped the run (run-local then exits 128 + it), 0 when none."""
    stopped_task: str | None = None

    def render(self, elapsed_s: float) -> str:
        if self.stopped_by:
            return self._stopped_text(elapsed_s)
        if self.succeeded:
            return render_summary(self.facts, elapsed_s=elapsed_s, pipeline_name=self.pipeline_name)
        lines = [
            f"pipeline FAILED after {elapsed_s:.0f} s in task {self.failed_task or '?'}: {self.cause()}",
            "its last log lines:",
        ]
        lines += [f"  | {line.strip()}" for line in without_traceback(self.failure_tail)[-SHOWN_TAIL_LINES:]]
        lines.append(f"full log: {self.log_path}")
        if self.run_dir:
            lines.append(f"artifacts of the finished tasks: {self.run_dir}")
        return "\n".join(lines)

    def _stopped_text(self, elapsed_s: float) -> str:
        where = f"task {self.stopped_task} was stopped" if self.stopped_task else "no task was running"
        lines = [f"pipeline STOPPED by {signal_name(self.stopped_by)} after {elapsed_s:.0f} s: {where}"]
        if self.stopped_task:
            lines += [f"  | {line.strip()}" for line in without_traceback(self.failure_tail)[-4:]]
        lines.append(f"full log: {self.log_path}")
        return "\n".join(lines)

    def cause(self) -> str:
        """The failed task's own reason: its last ``error:`` line, else the exception its traceback ended with."""
        return failure_cause(self.failure_tail) or "see its log lines"

    def failure_line(self) -> str:
        """One line for stderr: the failed task and its own error (the exception a component raised, or the
        ``error:`` line a command printed), never a traceback."""
        if self.stopped_by:
            return f"stopped by {signal_name(self.stopped_by)} (full log: {self.log_path})"
        cause = failure_cause(self.failure_tail) or "see its log lines above"
        return f"pipeline task {self.failed_task or '?'} failed: {cause} (full log: {self.log_path})"


ERROR_LINE = re.compile(r"^error(?: \(exit \d+\))?: (.+)$")
"""A command's or a step's own one-line reason (llmft/components/lib/step_exit.py, llmft/cli.py)."""
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*: (.+)$")
"""The last line of a traceback: ``module.ClassName: message`` (any class name)."""
SHOWN_TAIL_LINES = 12


def failure_cause(lines: list[str]) -> str:
    """The reason a task's log gives for its failure: its last ``error:`` line, else the exception line that ends
    its last traceback (the first unindented line after ``Traceback (most recent call last):``); '' if neither."""
    for line in reversed(lines):
        if found := ERROR_LINE.match(line.strip()):
            return found.group(1)
    cause, inside = "", False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            inside = True
        elif inside and line[:1] not in (" ", "\t", "") and (found := EXCEPTION_LINE.match(line)):
            cause, inside = found.group(1), False
    return cause


def without_traceback(lines: list[str]) -> list[str]:
    """``lines`` without Python traceback blocks (``Traceback ...`` and its indented frames; the exception's
    own line is kept)."""
    kept, inside = [], False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            inside = True
            continue
        if inside and (line[:1] in (" ", "\t") or line.startswith("During handling") or not line.strip()):
            continue
        inside = False
        kept.append(line)
    return kept


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


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
    raises for a failed task (see the outcome). The work folder is held for the whole run (WorkFolderInUse, exit 1,
    when another run holds it); SIGTERM stops the running task and the outcome records it (``stopped_by``)."""
    work = Path(work_dir).resolve()
    with work_folder_lock(work):
        return _run_locked(overrides, work, verbose, hpo, extra_defaults)


def _run_locked(overrides, work: Path, verbose: bool, hpo: bool, extra_defaults) -> LocalOutcome:
    # heavy: kfp
    from kfp import local

    # heavy: kfp
    from llmft.pipelines.llm_finetune import local_pipeline

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
        stop = StopForwarder()
        stream = ProgressStream(log, _screen(), verbose=verbose, stopped=lambda: stop.signum)
        stop.current = lambda: stream.current
        with stop:
            try:
                with contextlib.redirect_stdout(stream):
                    pipeline()  # every value is the local form's compiled default
                outcome.succeeded = not stop.signum
            except RuntimeError as exc:
                failed = FAILED_TASK.search(ANSI.sub("", str(exc)))
                outcome.failed_task = failed.group(1) if failed else None
                log.write(f"\n{redact_credentials(str(exc))}\n")
            except SignalStop as exc:
                if not stop.signum:
                    raise  # a second signal: stop now
                log.write(f"\nrun-local: {exc}; no further task was started\n")
        outcome.stopped_by, outcome.stopped_task = stop.signum, stop.task
        tail_of = outcome.failed_task or stop.task or ""
        outcome.failure_tail = list(stream.task_lines.get(tail_of, []))
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


def _width(stream) -> int:
    """Columns of the terminal ``stream`` writes to (a line that wraps cannot be overwritten with ``\\r``)."""
    try:
        return max(20, os.get_terminal_size(stream.fileno()).columns - 1)
    except (AttributeError, OSError, ValueError):
        return 100
