"""Can vLLM serve this PEFT adapter as a LoRA module? Checked before any deploy.

vLLM (``vllm/lora/peft_helper.py``) refuses adapters with DoRA or ``modules_to_save``,
a rank above ``--max-lora-rank``, or LoRA weights on modules it has no LoRA layer
for (routers, embeddings, lm_head on current versions); it loads safetensors. The
seeds' users met each of these only at serving time. This module finds them from
``adapter_config.json`` and the safetensors header alone: no torch, no model load.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

from llmft.trainer.errors import LlmftError

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""Values vLLM accepts for ``--max-lora-rank``."""

SUPPORTED_TARGET_MODULES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "qkv_proj",  # attention (Llama, Qwen2/3, Mistral)
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",  # dense MLP
        "w1",
        "w2",
        "w3",  # Mixtral-style experts
    }
)
"""Leaf module names vLLM has LoRA layers for in the decoder families this project trains.
Not included: routers (``gate`` of MoE blocks), ``embed_tokens`` and ``lm_head``."""

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


class AdapterNotServableError(LlmftError):
    """The adapter would be refused by vLLM; the message lists every reason and its fix."""


def _read_config(adapter_dir: Path) -> tuple[dict | None, list[str]]:
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        return None, [
            f"{path}: missing; a PEFT adapter directory needs adapter_config.json "
            "(save it with model.save_pretrained(dir))"
        ]
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        return None, [f"{path}: not valid JSON ({exc})"]
    if not isinstance(config, dict):
        return None, [f"{path}: must hold a JSON object"]
    return config, []


def safetensors_keys(path: Path) -> list[str]:
    """Tensor names in a safetensors file, read from its JSON header (8-byte length + JSON)."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return [key for key in header if key != "__metadata__"]


def non_lora_module_names(keys: Iterable[str]) -> set[str]:
    """Modules stored with full (non-LoRA) weights, e.g. ``...embed_tokens.weight`` -> embed_tokens
    (what ``modules_to_save`` or LoRA on tied embeddings leave in the file)."""
    names = set()
    for key in keys:
        parts = [p for p in key.split(".")[:-1] if p != "base_layer"]  # drop "weight"/"bias"
        if parts and not any(part in _LORA_PARTS for part in parts):
            names.add(parts[-1])
    return names


def lora_module_names(keys: Iterable[str]) -> set[str]:
    """Leaf names of the modules carrying LoRA weights, e.g. ``...self_attn.q_proj.lora_A.weight`` -> q_proj."""
    names = set()
    for key in keys:
        parts = key.split(".")
        for i, part in enumerate(parts):
            if part in _LORA_PARTS and i > 0:
                names.add(parts[i - 1])
                break
    return names


def _config_problems(config: dict, path: Path, max_lora_rank: int) -> list[str]:
    problems = []
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"{path}: peft_type={config.get('peft_type')!r}; vLLM serves LoRA adapters only")
    if config.get("use_dora"):
        problems.append(
            f"{path}: use_dora=true; vLLM does not support DoRA: retrain with lora.use_dora=false "
            "(or merge the adapter into the base model and serve that)"
        )
    if config.get("modules_to_save"):
        problems.append(
            f"{path}: modules_to_save={config['modules_to_save']}; vLLM requires none: retrain "
            "without modules_to_save (or merge and serve the merged model)"
        )
    if config.get("bias", "none") != "none":
        problems.append(f"{path}: bias={config['bias']!r}; vLLM supports bias='none' only")
    if max_lora_rank not in VLLM_MAX_LORA_RANKS:
        problems.append(f"max_lora_rank={max_lora_rank}: vLLM accepts only {list(VLLM_MAX_LORA_RANKS)}")
    ranks = {"r": config.get("r")} | {f"rank_pattern[{k}]": v for k, v in (config.get("rank_pattern") or {}).items()}
    for where, rank in ranks.items():
        if not isinstance(rank, int) or rank < 1:
            problems.append(f"{path}: {where}={rank!r} is not a positive integer rank")
        elif rank > max_lora_rank:
            problems.append(
                f"{path}: {where}={rank} exceeds max_lora_rank={max_lora_rank}: raise the serving "
                f"max LoRA rank to at least {rank} or retrain with a lower rank"
            )
    return problems


def _target_problems(config: dict, path: Path, supported: frozenset[str]) -> list[str]:
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) - supported)
        if unsupported:
            return [
                f"{path}: target_modules {unsupported} are not LoRA-servable by vLLM "
                f"(supported: {sorted(supported)}); retrain with lora.target_modules limited to those"
            ]
    elif targets is not None and not isinstance(targets, str):
        return [f"{path}: target_modules={targets!r} must be a list of module names"]
    return []


def _weights_problems(adapter_dir: Path, supported: frozenset[str]) -> list[str]:
    weights = adapter_dir / WEIGHTS_FILE
    pickled = sorted(p.name for p in adapter_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
    problems = []
    if pickled:
        problems.append(
            f"{adapter_dir}: pickled weights {pickled}; serve safetensors only "
            "(save with safe_serialization=True and delete these files)"
        )
    if not weights.is_file():
        return problems + [f"{weights}: missing; the adapter weights must be saved as safetensors"]
    try:
        keys = safetensors_keys(weights)
    except (OSError, ValueError, struct.error) as exc:
        return problems + [f"{weights}: unreadable safetensors header ({exc})"]
    modules, full = lora_module_names(keys), non_lora_module_names(keys)
    if any("lora_magnitude_vector" in key for key in keys):
        problems.append(f"{weights}: holds DoRA magnitude vectors; vLLM does not support DoRA")
    if full:
        problems.append(
            f"{weights}: full (non-LoRA) weights for {sorted(full)}; vLLM loads only lora_A/lora_B "
            "tensors: retrain without modules_to_save or LoRA on embeddings/lm_head, or merge"
        )
    if not modules:
        problems.append(f"{weights}: holds no LoRA weights (no lora_A/lora_B tensors)")
    unsupported = sorted(modules - supported)
    if unsupported:
        problems.append(
            f"{weights}: LoRA weights on modules {unsupported}, which vLLM has no LoRA layer for "
            f"(supported: {sorted(supported)})"
        )
    return problems


def check_vllm_servable(
    adapter_dir: str | Path,
    *,
    max_lora_rank: int = 64,
    supported_target_modules: Iterable[str] = SUPPORTED_TARGET_MODULES,
) -> list[str]:
    """Every reason vLLM would refuse the adapter in ``adapter_dir`` (empty list = servable)."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        return [f"{adapter_dir}: not a directory"]
    supported = frozenset(supported_target_modules)
    config, problems = _read_config(adapter_dir)
    if config is not None:
        path = adapter_dir / CONFIG_FILE
        problems += _config_problems(config, path, max_lora_rank) + _target_problems(config, path, supported)
    return problems + _weights_problems(adapter_dir, supported)


def require_vllm_servable(
    adapter_dir: str | Path,
    *,
    max_lora_rank: int = 64,
    supported_target_modules: Iterable[str] = SUPPORTED_TARGET_MODULES,
) -> None:
    """Raise ``AdapterNotServableError`` listing every problem ``check_vllm_servable`` finds."""
    problems = check_vllm_servable(
        adapter_dir, max_lora_rank=max_lora_rank, supported_target_modules=supported_target_modules
    )
    if problems:
        raise AdapterNotServableError(f"adapter {adapter_dir} cannot be served by vLLM:\n- " + "\n- ".join(problems))
