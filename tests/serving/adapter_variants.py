"""Adapters vLLM refuses, derived from a real one without torch (safetensors' numpy API)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _write(src: Path, out: Path, tensors: dict, config: dict) -> Path:
    from safetensors.numpy import save_file

    out.mkdir(parents=True)
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps(config))
    return out


def _load(src: Path) -> tuple[dict, dict]:
    from safetensors.numpy import load_file

    return load_file(str(src / WEIGHTS)), json.loads((src / CONFIG).read_text())


def wider_adapter(src: Path, out: Path, rank: int) -> Path:
    """``src`` with its LoRA rank raised to ``rank`` (A and B zero-padded; the config's ``r`` too)."""
    import numpy as np

    tensors, config = _load(src)
    for key, value in tensors.items():
        pad = rank - config["r"]
        if "lora_A" in key:
            tensors[key] = np.concatenate([value, np.zeros((pad, value.shape[1]), value.dtype)], axis=0)
        elif "lora_B" in key:
            tensors[key] = np.concatenate([value, np.zeros((value.shape[0], pad), value.dtype)], axis=1)
    return _write(src, out, tensors, {**config, "r": rank, "rank_pattern": {}})


def renamed_module_adapter(src: Path, out: Path, old: str = "q_proj", new: str = "foo_proj") -> Path:
    """``src`` with its ``old`` LoRA weights (and target module) renamed to a module the model does not have."""
    tensors, config = _load(src)
    tensors = {key.replace(f".{old}.", f".{new}."): value for key, value in tensors.items()}
    targets = config.get("target_modules")
    if isinstance(targets, list):
        config["target_modules"] = [new if t == old else t for t in targets]
    return _write(src, out, tensors, config)


def without_weights(src: Path, out: Path) -> Path:
    """``src``'s adapter_config.json alone: the weights file is missing."""
    out.mkdir(parents=True)
    shutil.copy(src / CONFIG, out / CONFIG)
    return out
