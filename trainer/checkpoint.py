"""Checkpoints under ``output_dir/checkpoints/step-<N>/`` and resuming from them.

A checkpoint holds the weights as safetensors (the PEFT adapter, or full
weights), ``optimizer.pt`` and ``scheduler.pt`` (DDP) or a ``deepspeed/`` folder
(ZeRO shards), ``rng/rank-<r>.pt`` for every rank, ``trainer_state.json``
(step, data position, tokens seen, metrics, best) and ``train_config.json`` (the
resolved config). Every rank writes its part into ``.step-<N>.partial``; after a
barrier rank 0 fsyncs, renames it to ``step-<N>`` and only then writes the
``COMPLETE`` marker (trainer/io.py). A directory without the marker is never
loaded. The output directory must be shared by all nodes (an RWX volume).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from llmft.trainer.config import diff_configs
from llmft.trainer.distributed import DistInfo, barrier
from llmft.trainer.errors import ConfigError
from llmft.trainer.io import atomic_write_json, atomic_write_text, is_complete

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "train_config.json"  # not config.json: full weights carry the HF model config.json


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint carrying its marker, oldest first."""
    root = checkpoints_root(output_dir)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = STEP_DIR.match(path.name)
            if match and path.is_dir() and is_complete(path):
                found.append((int(match.group(1)), path))
    return sorted(found)


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> Path | None:
    """The checkpoint to resume from: ``auto`` = newest complete one, ``never`` = none, else a path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not is_complete(path):
        raise ConfigError(
            f"resume={resume}: not a complete checkpoint (no COMPLETE marker); "
            "pick a step-<N> directory that has one, or use resume=auto"
        )
    return path


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def check_compatible(path: Path, config: dict, dataset_key: str, force: bool) -> list[str]:
    """Refuse to resume when the math-relevant config or the dataset changed (unless forced)."""
    old_config = json.loads((path / CONFIG_FILE).read_text())
    lines = diff_configs(old_config, config)
    old_key = read_state(path).get("dataset_cache_key")
    if old_key != dataset_key:
        lines.append(f"dataset cache_key: {old_key!r} -> {dataset_key!r}")
    if lines and not force:
        raise ConfigError(
            f"cannot resume from {path}: the run's settings differ from the checkpoint's:\n  "
            + "\n  ".join(lines)
            + "\nUse a new output_dir, set resume=never to start over, or force_resume=true to continue anyway."
        )
    return lines


# ----------------------------------------------------------------------------- saving


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    output_dir: str | Path, step: int, *, engine, info: DistInfo, lora: bool, state: dict, config: dict
) -> Path:
    """Write step-<step> from every rank; committed (renamed + marked) by rank 0."""
    root = checkpoints_root(output_dir)
    staging, final = root / f".step-{step}.partial", root / f"step-{step}"
    if info.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    torch.save(_rng_state(), _mkparent(staging / "rng" / f"rank-{info.rank}.pt"))
    save_weights(engine, staging, lora=lora, info=info)
    if engine.backend == "deepspeed":
        engine.wrapped.save_checkpoint(str(staging / "deepspeed"), tag="ds", save_latest=False)
    elif info.is_main:
        torch.save(engine.optimizer.state_dict(), staging / "optimizer.pt")
    if info.is_main:
        torch.save(engine.scheduler.state_dict(), staging / "scheduler.pt")
        atomic_write_json(staging / STATE_FILE, state)
        atomic_write_json(staging / CONFIG_FILE, config)
    barrier()
    if info.is_main:
        commit_directory(staging, final)
    barrier()
    return final


def _mkparent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def commit_directory(staging: Path, final: Path) -> None:
    """fsync every file, rename ``staging`` to ``final``, fsync the parent, then write COMPLETE."""
    for dirpath, _dirs, files in os.walk(staging):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():  # a step-N left without its marker by a crash
        shutil.rmtree(final)
    os.replace(staging, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    atomic_write_text(final / "COMPLETE", "ok\n")


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
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for p in model.parameters() if p.requires_grad]):
            if info.is_main:
                model.save_pretrained(directory, safe_serialization=True)
        return
    if info.is_main:
        model.save_pretrained(directory, safe_serialization=True)


# ----------------------------------------------------------------------------- loading


def load_checkpoint(path: Path, *, engine, info: DistInfo, lora: bool) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG; return trainer_state."""
    if not is_complete(path):
        raise ConfigError(f"{path}: checkpoint has no COMPLETE marker; it was never committed")
    if engine.backend == "deepspeed":
        engine.wrapped.load_checkpoint(
            str(path / "deepspeed"),
            tag="ds",
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=False,
        )
    else:
        load_weights(engine.module, path, lora=lora)
        engine.optimizer.load_state_dict(
            torch.load(path / "optimizer.pt", map_location=info.device, weights_only=False)
        )
    engine.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng = path / "rng" / f"rank-{info.rank}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    return read_state(path)


def load_weights(model, path: Path, *, lora: bool) -> None:
    from safetensors.torch import load_file

    if lora:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(str(path / "adapter_model.safetensors")))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ConfigError(f"{path}: adapter does not match the model (unexpected keys {unexpected[:3]})")
        return
    state: dict = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k and getattr(model.config, "tie_word_embeddings", False)}
    if unexpected or set(missing) - tied:
        raise ConfigError(
            f"{path}: full weights do not match the model (missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {unexpected[:3]})"
        )


# ----------------------------------------------------------------------------- retention


def prune_checkpoints(output_dir: str | Path, keep_last: int, best_step: int | None) -> list[Path]:
    """Delete complete checkpoints beyond the last ``keep_last`` (never the best) and any
    uncommitted leftovers. Rank 0 only. Returns what was removed."""
    root = checkpoints_root(output_dir)
    complete = complete_checkpoints(output_dir)
    keep = {step for step, _ in complete[-keep_last:]}
    if best_step is not None:
        keep.add(best_step)
    removed = [path for step, path in complete if step not in keep]
    if root.is_dir():
        for path in root.iterdir():
            uncommitted = path.name.endswith(".partial") or (STEP_DIR.match(path.name) and not is_complete(path))
            if uncommitted and path.is_dir():
                removed.append(path)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
