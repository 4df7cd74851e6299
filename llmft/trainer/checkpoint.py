"""Checkpoints under ``output_dir/checkpoints/step-<N>/`` and resuming from them.

A checkpoint holds the weights as safetensors (the PEFT adapter, or full weights),
``optimizer.pt`` (DDP; loaded with ``weights_only=True``) or a ``deepspeed/`` folder (ZeRO
shards), ``scheduler.json``, ``rng/rank-<r>.json`` for every rank, ``trainer_state.json`` (step,
data position, tokens seen, metrics, best, the run's ``run_id``) and ``train_config.json`` (the
resolved config). Nothing is unpickled beyond plain tensors: the checkpoints live on a shared
volume, and a tampered file must not run code in a pod that holds credentials.

Every rank writes its part into ``.step-<N>.partial``; after a barrier rank 0 gives the files the
umask-based mode, fsyncs, renames it to ``step-<N>`` and only then writes the ``COMPLETE`` marker.
A directory without the marker is never loaded, nor one whose files do not read as whole
(llmft/trainer/checkpoint_check.py: ``resume=auto`` falls back to an older one). Pruning only touches checkpoints whose
``run_id`` is this run's. The output directory must be shared by all nodes (an RWX volume).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch

from llmft.trainer.checkpoint_check import (
    CONFIG_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    STEP_DIR,
    checkpoint_problem,
)
from llmft.trainer.config_load import diff_configs
from llmft.trainer.distributed import DistInfo, barrier
from llmft.trainer.errors import ConfigError, DataError
from llmft.trainer.io import TRAINING_MANIFEST, atomic_write_json, atomic_write_text, is_complete, share_files
from llmft.trainer.storage import disk_guard

SHAPE_SETTINGS = ("method", "lora.r", "lora.target_modules", "lora.use_dora")
"""Settings whose change gives the model other trainable tensors (names or shapes) than the checkpoint
holds: force_resume cannot continue across them (the weights would not load)."""
# What a DeepSpeed checkpoint may reference besides plain tensors (torch's weights_only set): the
# globals of the ZeRO-1/2/3 checkpoints DeepSpeed 0.19 writes (listed with
# torch.serialization.get_unsafe_globals_in_checkpoint), and the dynamic loss scaler of fp16 runs.
DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path, run_id: str | None = None) -> list[tuple[int, Path]]:
    """(step, path) of every trainer checkpoint carrying its marker (of run ``run_id`` when given),
    oldest first. A ``step-N`` folder without ``trainer_state.json`` is not one of ours."""
    root = checkpoints_root(output_dir)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = STEP_DIR.match(path.name)
            if match and path.is_dir() and is_complete(path) and (path / STATE_FILE).is_file():
                if run_id is None or _run_id_of(path) == run_id:
                    found.append((int(match.group(1)), path))
    return sorted(found)


def finished_run_id(output_dir: str | Path) -> str:
    """The ``run_id`` of the run that finished in ``output_dir`` (from ``final/training_manifest.json``): the
    one whose checkpoints :func:`complete_checkpoints` lists for the steps that read a finished run."""
    path = Path(output_dir) / "final" / TRAINING_MANIFEST
    try:
        run_id = json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        run_id = None
    if not isinstance(run_id, str) or not run_id:
        raise DataError(
            f"{path}: missing or without a run_id: the training run in {output_dir} did not finish. "
            "Check the training step's logs, then run it again (it resumes from the newest checkpoint)"
        )
    return run_id


def _run_id_of(path: Path) -> str | None:
    try:
        run_id = read_state(path).get("run_id")
    except (OSError, ValueError, AttributeError):  # unreadable, or JSON that is not an object
        return None
    return run_id if isinstance(run_id, str) else None


@dataclass
class ResumeChoice:
    """The checkpoint to resume from (None: start fresh), and the newer complete ones passed over as
    corrupt: (folder, the line naming the bad file)."""

    path: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> ResumeChoice:
    """The checkpoint to resume from: ``auto`` = the newest complete one that reads as whole
    (:func:`checkpoint_problem`; newer corrupt ones are listed in ``skipped``), ``never`` = none, else a
    path, which must be complete and whole (ConfigError naming the bad file otherwise)."""
    if resume == "never":
        return ResumeChoice(None)
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        skipped: list[tuple[Path, str]] = []
        for _step, path in reversed(found):
            problem = checkpoint_problem(path)
            if problem is None:
                return ResumeChoice(path, skipped)
            skipped.append((path, problem))
        if skipped:
            raise ConfigError(
                f"{skipped[0][1]}; and no older checkpoint in {checkpoints_root(output_dir)} reads as whole "
                f"({len(skipped)} checked), so there is nothing safe to resume from. Move the checkpoints away (or "
                "use a new output_dir) to start over"
            )
        return ResumeChoice(None)
    path = Path(resume)
    if not is_complete(path):
        raise ConfigError(
            f"resume={resume}: not a complete checkpoint (no COMPLETE marker); "
            "pick a step-<N> directory that has one, or use resume=auto"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(
            f"resume={resume}: {problem}; this checkpoint cannot be resumed. Pick another step-<N> directory, or "
            "use resume=auto (the newest checkpoint that reads as whole)"
        )
    return ResumeChoice(path)


def set_aside_name(path: Path) -> Path:
    """Where a corrupt checkpoint folder is kept: ``step-N.corrupt`` (``.corrupt-2``, ... when taken); the
    name matches no ``step-N``, so it is never listed, resumed, pruned or replaced."""
    candidate, number = path.with_name(f"{path.name}.corrupt"), 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.corrupt-{number}")
    return candidate


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def check_compatible(path: Path, config: dict, dataset_key: str, force: bool) -> list[str]:
    """Refuse to resume when the math-relevant config or the dataset changed (unless forced), in one
    line naming each changed setting with its old and new value, and the fix."""
    old_config = json.loads((path / CONFIG_FILE).read_text())
    lines = diff_configs(old_config, config)
    old_key = read_state(path).get("dataset_cache_key")
    if old_key != dataset_key:
        lines.append(f"dataset cache_key: {old_key!r} -> {dataset_key!r}")
    shapes = [line for line in lines if line.split(":")[0] in SHAPE_SETTINGS]
    if shapes:
        forced = ", even with force_resume=true" if force else ""
        raise ConfigError(
            f"cannot resume from {path}{forced}: {'; '.join(shapes)} changes which tensors the model trains, so the "
            "checkpoint's weights and optimizer state do not fit it. Set it back to resume, or use a new output_dir "
            "to train with the new setting"
        )
    if lines and not force:
        raise ConfigError(
            f"cannot resume from {path}: the run's settings differ from the checkpoint's ({'; '.join(lines)}). "
            "Set them back to resume, use a new output_dir to start over, or force_resume=true to continue anyway"
        )
    return lines


# ----------------------------------------------------------------------------- RNG state as JSON


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """Python, NumPy, torch (and CUDA) generator states as JSON-serialisable values."""
    version, internal, gauss = random.getstate()
    legacy = np.random.get_state()  # the legacy tuple (legacy=True is the default)
    kind, keys, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], legacy)
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_from_b64(state["torch"]) if isinstance(state["torch"], str) else state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        torch.cuda.set_rng_state(_from_b64(cuda) if isinstance(cuda, str) else cuda)


# ----------------------------------------------------------------------------- saving


def save_checkpoint(
    output_dir: str | Path, step: int, *, engine, info: DistInfo, lora: bool, state: dict, config: dict
) -> Path:
    """Write step-<step> from every rank; committed (renamed + marked) by rank 0."""
    root = checkpoints_root(output_dir)
    staging, final = root / f".step-{step}.partial", root / f"step-{step}"
    guard = disk_guard(
        final,
        what=f"checkpoint step-{step}",
        needed=checkpoint_bytes(engine.module, lora),
        cleanup=[staging] if info.is_main else [],  # a failed write leaves no .step-N.partial behind
    )
    with guard:
        if info.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        barrier()
        atomic_write_json(staging / "rng" / f"rank-{info.rank}.json", rng_state())
        save_weights(engine, staging, lora=lora, info=info)
        if engine.backend == "deepspeed":
            engine.wrapped.save_checkpoint(str(staging / "deepspeed"), tag="ds", save_latest=False)
        elif info.is_main:
            torch.save(engine.optimizer.state_dict(), staging / "optimizer.pt")
        if info.is_main:
            atomic_write_json(staging / SCHEDULER_FILE, engine.scheduler.state_dict())
            atomic_write_json(staging / STATE_FILE, state)
            atomic_write_json(staging / CONFIG_FILE, config)
        barrier()
        if info.is_main:
            commit_directory(staging, final)
    barrier()
    return final


def checkpoint_bytes(model, lora: bool, *, optimizer: bool = True) -> int:
    """About what one checkpoint takes on disk: the saved weights (the adapter's trainable tensors, or
    every parameter) plus (``optimizer``) AdamW's two moments per trainable parameter, in the
    parameters' dtypes (a ZeRO-3 parameter counts its full size, ``ds_numel``)."""
    weights = moments = 0
    for param in model.parameters():
        size = getattr(param, "ds_numel", param.numel()) * param.element_size()
        if param.requires_grad and optimizer:
            moments += 2 * size
        if param.requires_grad or not lora:
            weights += size
    return weights + moments


def write_final(output_dir: str | Path, *, engine, info: DistInfo, lora: bool, extras) -> Path:
    """``output_dir/final/``: the weights from every rank, then ``extras(staging)`` on rank 0 (tokenizer,
    manifest), committed like a checkpoint."""
    final = Path(output_dir) / "final"
    staging = final.with_name(".final.partial")
    needed = checkpoint_bytes(engine.module, lora, optimizer=False)
    with disk_guard(final, what="final/", needed=needed, cleanup=[staging] if info.is_main else []):
        if info.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        barrier()
        save_weights(engine, staging, lora=lora, info=info)
        if info.is_main:
            extras(staging)
            commit_directory(staging, final)
    barrier()
    return final


def commit_directory(staging: Path, final: Path) -> None:
    """Share the files (umask mode), fsync them, rename ``staging`` to ``final``, fsync the parent,
    then write COMPLETE."""
    share_files(staging)
    for dirpath, _dirs, files in os.walk(staging):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
    _clear_target(final)
    os.replace(staging, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    atomic_write_text(final / "COMPLETE", "ok\n")


def _clear_target(final: Path) -> None:
    """Make room for ``final``: ours (a step-N or final/ a crash left without its marker) is
    deleted; a folder of that name that the trainer did not write (in an output_dir used with
    force_output_dir) is kept, renamed to ``<name>.kept-<time>``."""
    if not final.exists():
        return
    if (final / STATE_FILE).is_file() or (final / TRAINING_MANIFEST).is_file():
        shutil.rmtree(final)
        return
    aside = final.with_name(f"{final.name}.kept-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(final, aside)
    print(f"[llmft] warning: {final} was not written by the trainer; kept as {aside}", flush=True)


def save_weights(engine, directory: Path, *, lora: bool, info: DistInfo) -> None:
    """Adapter (adapter_model.safetensors + adapter_config.json) or full weights, from rank 0.
    Under ZeRO-3 the partitioned parameters are gathered first (a collective on all ranks)."""
    model = engine.module
    zero3 = engine.backend == "deepspeed" and getattr(engine.wrapped, "zero_optimization_stage", lambda: 0)() == 3
    if zero3 and not lora:
        state = engine.wrapped._zero3_consolidated_16bit_state_dict()
        if info.is_main:
            model.save_pretrained(directory, state_dict=state, safe_serialization=True)
        return
    if zero3:
        # heavy: deepspeed
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for p in model.parameters() if p.requires_grad]):
            if info.is_main:
                model.save_pretrained(directory, safe_serialization=True)
        return
    if info.is_main:
        model.save_pretrained(directory, safe_serialization=True)


# ----------------------------------------------------------------------------- loading


def load_checkpoint(path: Path, *, engine, info: DistInfo, lora: bool) -> tuple[dict, list[str]]:
    """Restore weights, optimizer, scheduler and this rank's RNG; return (trainer_state, warnings)."""
    if not is_complete(path):
        raise ConfigError(f"{path}: checkpoint has no COMPLETE marker; it was never committed")
    if engine.backend == "deepspeed":
        check_deepspeed_files(path / "deepspeed")
        engine.wrapped.load_checkpoint(
            str(path / "deepspeed"),
            tag="ds",
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=False,
        )
    else:
        load_weights(engine.module, path, lora=lora)
        engine.optimizer.load_state_dict(load_tensors(path / "optimizer.pt", map_location=info.device))
    engine.scheduler.load_state_dict(_scheduler_state(path))
    rng = _rng_of_rank(path, info.rank)
    if rng is None:
        saved = len(list((path / "rng").glob("rank-*"))) if (path / "rng").is_dir() else 0
        return read_state(path), [
            f"rank {info.rank}: {path}/rng has no rank-{info.rank}.json (saved by {saved} rank(s)); this rank's "
            "random streams (dropout) start from the seed, so the run will not repeat an uninterrupted one exactly"
        ]
    set_rng_state(rng)
    return read_state(path), []


def load_tensors(path: Path, map_location=None, allowed: tuple = ()):
    """``torch.load(weights_only=True)``: plain tensors and containers only (plus ``allowed``
    globals); anything else is refused with a ConfigError naming the file."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"(?:unsupported GLOBAL|Unsupported global: GLOBAL) (\S+)", str(exc))
        what = f"it references {found.group(1)}" if found else str(exc).splitlines()[0]
        raise ConfigError(
            f"{path}: refused to load: not a plain tensor file ({what}); it may have been tampered with. "
            "Resume from another checkpoint (resume=<path>) or start in a new output_dir"
        ) from None


def _scheduler_state(path: Path) -> dict:
    if (path / SCHEDULER_FILE).is_file():
        return json.loads((path / SCHEDULER_FILE).read_text())
    return load_tensors(path / "scheduler.pt")  # written by llmft before scheduler.json


def _rng_of_rank(path: Path, rank: int) -> dict | None:
    current, legacy = path / "rng" / f"rank-{rank}.json", path / "rng" / f"rank-{rank}.pt"
    if current.is_file():
        return json.loads(current.read_text())
    if legacy.is_file():  # written by llmft before the JSON format: NumPy's state needs these types
        numpy_types = (np.ndarray, np.dtype, type(np.dtype(np.uint32)), _numpy_reconstruct())
        return load_tensors(legacy, allowed=numpy_types)
    return None


def _numpy_reconstruct():
    core = getattr(np, "_core", None) or np.core
    return core.multiarray._reconstruct


def check_deepspeed_files(folder: Path) -> None:
    """DeepSpeed unpickles its files without torch's weights-only guard: list what each references
    first (torch's scanner, nothing executed) and refuse anything beyond plain tensors and
    DeepSpeed's own checkpoint types."""
    for file in sorted(folder.rglob("*.pt")):
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(file)))
        except (RuntimeError, ValueError, pickle.UnpicklingError) as exc:
            raise ConfigError(f"{file}: unreadable DeepSpeed checkpoint file ({exc})") from None
        if unsafe - DEEPSPEED_GLOBALS:
            raise ConfigError(
                f"{file}: refused to load: it references {sorted(unsafe - DEEPSPEED_GLOBALS)}, which no DeepSpeed "
                "checkpoint needs; it may have been tampered with. Resume from another checkpoint or a new output_dir"
            )


def load_weights(model, path: Path, *, lora: bool) -> None:
    # heavy: safetensors
    from safetensors.torch import load_file

    if lora:
        # heavy: peft
        from peft import set_peft_model_state_dict

        with _shapes_must_fit(path):
            result = set_peft_model_state_dict(model, load_file(str(path / "adapter_model.safetensors")))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ConfigError(f"{path}: adapter does not match the model (unexpected keys {unexpected[:3]})")
        return
    state: dict = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    with _shapes_must_fit(path):
        missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k and getattr(model.config, "tie_word_embeddings", False)}
    if unexpected or set(missing) - tied:
        raise ConfigError(
            f"{path}: full weights do not match the model (missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {unexpected[:3]})"
        )


@contextlib.contextmanager
def _shapes_must_fit(path: Path) -> Iterator[None]:
    """torch's ``size mismatch for <name>`` (a checkpoint of another lora.r, target set or model) as one
    ConfigError naming the checkpoint, not an internal error."""
    try:
        yield
    except RuntimeError as exc:
        found = re.search(r"size mismatch for [^\n]*", str(exc))
        if found is None:
            raise
        raise ConfigError(
            f"{path}: the checkpoint's weights do not fit the model ({found.group(0).strip()}): it was trained with "
            "another lora.r, lora.target_modules, method or base model. Set those back to resume, or use a new "
            "output_dir"
        ) from None


# ----------------------------------------------------------------------------- retention


def best_checkpoint_step(output_dir: str | Path, run_id: str) -> int | None:
    """This run's complete checkpoint with the lowest eval loss measured at its own step (ties: the earliest);
    None when none was evaluated. :func:`prune_checkpoints` never deletes it."""
    scored = []
    for step, path in complete_checkpoints(output_dir, run_id):
        evaluation = read_state(path).get("eval")
        if evaluation:
            scored.append((evaluation["eval_loss"], step))
    return min(scored)[1] if scored else None


def prune_checkpoints(output_dir: str | Path, keep_last: int, best_step: int | None, run_id: str) -> list[Path]:
    """Delete this run's complete checkpoints beyond the last ``keep_last`` (never the best) and any
    uncommitted leftovers of ours (``.step-N.partial``, ``step-N`` without its marker). Checkpoints
    of another run are never touched. Rank 0 only. Returns what was removed."""
    root = checkpoints_root(output_dir)
    ours = complete_checkpoints(output_dir, run_id)
    keep = {step for step, _ in ours[-keep_last:]}
    if best_step is not None:
        keep.add(best_step)
    removed = [path for step, path in ours if step not in keep]
    if root.is_dir():
        for path in root.iterdir():
            this_run = path.name.endswith(".partial") or _run_id_of(path) == run_id
            uncommitted = path.name.endswith(".partial") or (STEP_DIR.match(path.name) and not is_complete(path))
            if uncommitted and this_run and path.is_dir():
                removed.append(path)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
