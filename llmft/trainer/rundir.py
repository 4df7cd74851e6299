"""The run directory (``output_dir``): what a run may touch there, and whether it may start.

:func:`plan_start` makes every decision that needs no model and no GPU, reading only: the
model source exists, the tokenized data and its splits are usable, ``output_dir`` is ours,
a fresh run does not land on an old one, which checkpoint to resume and whether it matches,
and the restart budget. ``llmft train --nproc N`` runs it before starting any rank (so a bad
config is one line, not one per rank); rank 0 runs it again and then :func:`claim_run` writes:

- **Ownership.** The trainer marks ``output_dir`` with the owner file (kind ``training-run``)
  and refuses a non-empty directory without it (another program's folder, or llmft output of
  another kind) unless ``force_output_dir=true``; a launcher's ``train.log`` and the plan step's
  ``config.yaml`` alone are allowed.
- **No mixing.** ``resume=never`` in a directory that already holds a run is refused: a fresh
  run would prune and overwrite the old run's checkpoints and metrics. Use a new output_dir.
- **One run at a time.** Rank 0 locks ``output_dir`` (llmft/trainer/runlock.py) before planning; a
  second run into it exits 1 naming the holder, or waits with ``wait_for_output_dir=true``.
- **Never from a corrupt checkpoint.** ``resume=auto`` passes over a newer complete checkpoint whose
  files do not read as whole (llmft/trainer/checkpoint_check.py: truncated weights or optimizer.pt, a
  trainer_state.json that is not valid or names another step) and resumes from the newest one
  that does; the warning names the bad file, and :func:`claim_run` sets the bad folder aside as
  ``step-N.corrupt`` (kept for inspection, never pruned). A bad ``resume=<path>``, or no whole
  checkpoint at all, exits 1 naming the file.
- **Restart budget.** Under the Training Operator's ``ExitCode`` policy a pod that dies with a
  retryable code (137 OOM kill, 134 NCCL abort, 139 crash) is recreated without end: its
  backoffLimit never trips (kubeflow/trainer#2045). ``restarts.json`` counts the starts that
  followed a retryable death without a new complete checkpoint; past
  ``max_restarts_without_progress`` the run exits 1.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from llmft.trainer import checkpoint as ckpt
from llmft.trainer import runlock
from llmft.trainer.config import RUN_CONFIG_FILE
from llmft.trainer.data.loader import dataset_info, has_supervised_targets, resolve_global_sequences
from llmft.trainer.data.shards import open_split
from llmft.trainer.distributed import broadcast_object
from llmft.trainer.errors import ConfigError, DataError, LlmftError, OutputNotOursError
from llmft.trainer.io import atomic_write_json, owner_kind, write_owner

RUN_KIND = "training-run"
RESTARTS_FILE = "restarts.json"
# a launcher's log; the lock of a run that failed early; the config the pipeline's plan step wrote for this run
LAUNCHER_FILES = frozenset({"train.log", runlock.LOCK_FILE, RUN_CONFIG_FILE})
RUN_CONTENTS = ("checkpoints", "final", "metrics.jsonl", "tensorboard")
RETRYABLE_OUTCOMES = ("running", 130, 143, 200)  # "running": died without recording (SIGKILL, abort, crash)


@dataclass
class StartPlan:
    """What rank 0 decided before loading anything; broadcast to every rank."""

    dataset: dict  # the tokenized dataset's manifest
    total_steps: int
    run_id: str
    resume_path: Path | None = None
    resume_diffs: list[str] = field(default_factory=list)
    eval_note: str | None = None  # why the run trains without evaluation (None: it evaluates)
    restarts: int = 0  # starts without progress before this one
    set_aside: list[tuple[str, str, str]] = field(default_factory=list)  # corrupt checkpoint, kept as, why
    lock: runlock.RunLock | None = field(default=None, repr=False, compare=False)  # rank 0's, never broadcast


def plan_start(cfg, config_dict: dict) -> StartPlan:
    """Every check that reads only (see the module docstring); raises LlmftError."""

    check_model_source(cfg.model.name_or_path)
    dataset = dataset_info(cfg.data)
    eval_note = check_splits(cfg)
    check_ownership(cfg.output_dir, cfg.force_output_dir)
    check_fresh_start(cfg.output_dir, cfg.resume)
    total_steps = planned_steps(cfg, dataset)
    choice = ckpt.find_resume_checkpoint(cfg.resume, cfg.output_dir)
    resume_path = choice.path
    plan = StartPlan(dataset, total_steps, uuid.uuid4().hex[:12], resume_path, eval_note=eval_note)
    plan.set_aside = [(str(path), str(ckpt.set_aside_name(path)), problem) for path, problem in choice.skipped]
    if resume_path is not None:
        plan.resume_diffs = ckpt.check_compatible(resume_path, config_dict, dataset["cache_key"], cfg.force_resume)
        state = ckpt.read_state(resume_path)
        plan.run_id = state.get("run_id") or plan.run_id
        check_resume_step(resume_path, int(state["step"]), total_steps)
    plan.restarts = restarts_before(cfg.output_dir, cfg.max_restarts_without_progress)
    return plan


def decide(cfg, config_dict: dict, info) -> StartPlan:
    """Rank 0 locks output_dir, plans the run and claims the directory; every rank gets the same plan (or
    error). Rank 0's lock rides on its plan (``plan.lock``, set after the broadcast) until the trainer closes."""

    plan = error = lock = None
    if info.is_main:
        try:
            check_ownership(cfg.output_dir, cfg.force_output_dir)  # before a lock file is written into it
            lock = runlock.acquire(cfg.output_dir, wait=cfg.wait_for_output_dir, say=_say)
            plan = plan_start(cfg, config_dict)
            claim_run(cfg, plan)
        except LlmftError as exc:
            error = exc
    plan, error = broadcast_object((plan, error))
    if error is not None:
        if lock is not None:
            lock.release()
        raise error
    plan.lock = lock
    return plan


def _say(text: str) -> None:
    print(text, flush=True)


def claim_run(cfg, plan: StartPlan) -> None:
    """Rank 0: create and mark ``output_dir``, and record this start in the restart budget."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if owner_kind(out) != RUN_KIND:
        write_owner(out, RUN_KIND)
    for corrupt, kept, _why in plan.set_aside:
        os.replace(corrupt, kept)
    _write_restarts(out, plan.restarts, newest_step(out), "running")


# ----------------------------------------------------------------------------- inputs


def check_model_source(name: str) -> None:
    """A local model directory must exist and hold config.json; anything else is a hub id
    (``org/name`` or ``name``), which the hub validates when it is loaded."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ConfigError(f"model.name_or_path={name}: not a model directory (no config.json in it)")
        return
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise ConfigError(
            f"model.name_or_path={name}: no such directory; give a local model directory or a hub id "
            "such as Qwen/Qwen2.5-0.5B-Instruct"
        )


def check_splits(cfg) -> str | None:
    """Both splits must exist; an eval split without a supervised token (``--val-fraction 0``)
    means training without evaluation. Returns that note, or None when evaluation works."""

    for split in ("train", cfg.eval.split):
        if not (Path(cfg.data) / split / "input_ids.npy").is_file():
            raise DataError(
                f"{Path(cfg.data) / split}: split missing from the tokenized dataset "
                f"(re-run `llmft data tokenize`, or set eval.split)"
            )
    if has_supervised_targets(cfg.data, cfg.eval.split, cfg.eval.max_sequences):
        return None
    return (
        f"{Path(cfg.data) / cfg.eval.split}: no supervised token to evaluate on (an empty validation split, e.g. "
        "`llmft data prepare --val-fraction 0`): training WITHOUT evaluation; final/ carries no eval loss"
    )


def planned_steps(cfg, dataset: dict) -> int:
    """Optimizer steps of the run, as every rank's loader will count them."""

    sequences = resolve_global_sequences(
        cfg.batch.global_sequences, cfg.batch.global_tokens, int(dataset["max_length"])
    )
    available = len(open_split(cfg.data, "train"))
    if available < sequences:
        raise DataError(
            f"{Path(cfg.data) / 'train'}: {available} training sequences, fewer than one global batch of "
            f"{sequences}; lower batch.global_sequences (or batch.global_tokens)"
        )
    return cfg.max_steps if cfg.max_steps > 0 else max(1, int(cfg.epochs * (available // sequences)))


# ----------------------------------------------------------------------------- the directory


def check_ownership(output_dir: str, force: bool) -> None:
    """Refuse a non-empty ``output_dir`` that is not marked as a training run (unless forced)."""
    path = Path(output_dir)
    if not path.exists():
        return
    if not path.is_dir():
        raise OutputNotOursError(f"output_dir={output_dir} is a file; choose a directory path for the run")
    kind = owner_kind(path)
    if kind == RUN_KIND or force:
        return
    entries = sorted(e.name for e in path.iterdir() if e.name not in LAUNCHER_FILES)
    if not entries:
        return
    what = f"holds llmft's {kind}" if kind else "was not written by an llmft training run"
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    raise OutputNotOursError(
        f"output_dir={output_dir} is a non-empty directory that {what} ({shown}); refusing to write checkpoints/, "
        "final/ and metrics.jsonl into it. Choose a new output_dir, or set force_output_dir=true to use it anyway"
    )


def check_fresh_start(output_dir: str, resume: str) -> None:
    """``resume=never`` must not start a second run on top of an old one."""
    path = Path(output_dir)
    if resume != "never" or not path.is_dir():
        return
    held = [name for name in RUN_CONTENTS if (path / name).exists() and _non_empty(path / name)]
    if held:
        raise ConfigError(
            f"output_dir={output_dir} already holds a training run ({', '.join(held)}); resume=never would mix a new "
            "run with it. Use a new output_dir, move the old run away, or set resume=auto to continue it"
        )


def _non_empty(path: Path) -> bool:
    return path.is_file() or any(path.iterdir())


def check_resume_step(path: Path, step: int, total_steps: int) -> None:
    if step > total_steps:
        raise ConfigError(
            f"resume: {path} is at step {step}, past this run's {total_steps} steps (max_steps); there is nothing to "
            "train. Raise max_steps to continue, use its weights as they are, or start in a new output_dir"
        )


def newest_step(output_dir: str | Path) -> int:
    found = ckpt.complete_checkpoints(output_dir)
    return found[-1][0] if found else 0


# ----------------------------------------------------------------------------- restart budget


def read_restarts(output_dir: str | Path) -> dict | None:
    try:
        record = json.loads((Path(output_dir) / RESTARTS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def restarts_before(output_dir: str | Path, limit: int) -> int:
    """Starts without progress that this start follows; ConfigError once past ``limit`` (0 = no limit).

    A start counts when the previous one died without recording its outcome (SIGKILL, OOM kill,
    abort, crash) or exited retryably (130, 143, 200), and no new complete checkpoint appeared."""
    record = read_restarts(output_dir)
    if record is None:
        return 0
    progressed = newest_step(output_dir) > int(record.get("checkpoint_step", 0))
    if progressed or record.get("outcome") not in RETRYABLE_OUTCOMES:
        return 0
    count = int(record.get("starts_without_progress", 0)) + 1
    if limit and count > limit:
        path, step = Path(output_dir) / RESTARTS_FILE, record.get("checkpoint_step", 0)
        raise ConfigError(
            f"{path}: {count} starts in a row died before a new checkpoint (newest: step {step}, last outcome "
            f"{record.get('outcome')}); stopping the restart loop (max_restarts_without_progress="
            f"{limit}). Read the previous attempt's log (OOM kill 137, NCCL abort 134, crash 139), fix the cause, then "
            f"delete {path} to allow {limit} more restarts"
        )
    return count


def record_outcome(output_dir: str | Path, exit_code: int) -> None:
    """Rank 0 at exit: how this start ended (the next start reads it). The checkpoint step stays
    the one this start began from, so a checkpoint committed since counts as progress."""
    record = read_restarts(output_dir)
    if record is not None:
        count, step = int(record.get("starts_without_progress", 0)), int(record.get("checkpoint_step", 0))
        _write_restarts(Path(output_dir), count, step, exit_code)


def _write_restarts(out: Path, count: int, step: int, outcome) -> None:
    atomic_write_json(
        out / RESTARTS_FILE,
        {
            "starts_without_progress": count,
            "checkpoint_step": step,
            "outcome": outcome,
            "pid": os.getpid(),
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )


def set_aside_notes(plan: StartPlan) -> list[str]:
    """One warning per corrupt checkpoint the plan passed over (named file, where the folder is kept)."""
    resumed = f"resuming from {Path(plan.resume_path).name}" if plan.resume_path else "starting fresh"
    return [
        f"{why}: not resumed from (never resume from a corrupt checkpoint); {resumed}, the newest that reads as "
        f"whole. The folder is kept as {kept}: inspect it, then delete it"
        for _corrupt, kept, why in plan.set_aside
    ]
