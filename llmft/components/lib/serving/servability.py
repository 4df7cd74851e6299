"""Can vLLM serve this PEFT adapter as a LoRA module? Checked before any deploy.

vLLM (``vllm/lora/peft_helper.py``) refuses adapters with DoRA or ``modules_to_save``,
a rank above ``--max-lora-rank``, or LoRA weights on modules it has no LoRA layer
for (routers, embeddings, lm_head on current versions); it loads safetensors. The
seeds' users met each of these only at serving time. This module finds them from
``adapter_config.json`` and the safetensors header alone: no torch, no model load.

Mixture-of-experts adapters, checked against vLLM 0.24.0 (:data:`VLLM_VERSION_CHECKED`):
LoRA on the attention projections is served as on dense models. LoRA on the experts as PEFT
saves it for transformers 5.x models (``target_parameters``: one fused 3-D tensor pair per layer,
keys ``...mlp.experts.base_layer.lora_*`` = gate_up_proj and ``...mlp.experts.lora_*`` =
down_proj) is loaded only by models vLLM flags ``is_3d_moe_weight`` or by a server started with
``--enable-mixed-moe-lora-format`` and the adapter given as ``--lora-modules
'{"name": ..., "path": ..., "is_3d_lora_weight": true}'`` (``vllm/lora/model_manager.py``
``_convert_3d_to_2d_moe_lora``). ``Qwen3MoeForCausalLM`` is not flagged, and without that flag
``FusedMoEWithLoRA.set_lora`` asserts on the fused tensors, so the adapter fails when it loads.
The deploy step starts vLLM with ``--lora-modules name=path``: expert adapters are refused here
unless the caller says the server runs the mixed format. The router (``gate``) has no LoRA layer.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

from llmft.trainer.errors import LlmftError

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""Values vLLM accepts for ``--max-lora-rank``."""

VLLM_VERSION_CHECKED = "0.24.0"
"""The vLLM these rules were read from: the one KServe v0.20.0's huggingfaceserver image installs
(kserve ``python/kserve/pyproject.toml`` llm extra ``vllm==0.24.0``;
``python/huggingface_server.Dockerfile`` ``ARG VLLM_VERSION=0.24.0``). Fused-MoE LoRA arrived in
vLLM 0.11.2 (PR 21229); the mixed 2-D/3-D MoE adapter format is in 0.24.0."""

EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")
"""PEFT ``target_parameters`` of a fused-expert adapter (what ``lora.target_modules: [..., experts]`` saves)."""

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
        parts = [p for p in key.split(".") if p != "base_layer"]
        if parts[-1] in ("weight", "bias"):  # PEFT saves a DoRA magnitude as `...lora_magnitude_vector`, bare
            parts = parts[:-1]
        if parts and not any(part in _LORA_PARTS for part in parts):
            names.add(parts[-1])
    return names


def lora_module_names(keys: Iterable[str]) -> set[str]:
    """Leaf names of the modules carrying LoRA weights, e.g. ``...self_attn.q_proj.lora_A.weight`` -> q_proj
    (PEFT's nested ``ParamWrapper`` keys ``...experts.base_layer.lora_A.weight`` -> experts)."""
    names = set()
    for key in keys:
        parts = [p for p in key.split(".") if p != "base_layer"]
        for i, part in enumerate(parts):
            if part in _LORA_PARTS and i > 0:
                names.add(parts[i - 1])
                break
    return names


def _moe_problems(config: dict, keys: list[str], path: Path, moe_3d_lora_format: bool) -> list[str]:
    """Fused (3-D) expert LoRA: servable only with vLLM's mixed MoE LoRA format, and only as the pair."""
    targets = set(config.get("target_parameters") or ()) if config else set()
    fused = {t for t in targets if t.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")}
    if not fused and not any(".experts.lora_" in k or ".experts.base_layer.lora_" in k for k in keys):
        return []
    if not moe_3d_lora_format:
        return [
            f"{path}: LoRA on the fused MoE expert tensors (target_parameters {sorted(fused) or 'experts'}); vLLM "
            f"{VLLM_VERSION_CHECKED} (KServe 0.20) loads these for Qwen3-MoE only with --enable-mixed-moe-lora-format "
            'and --lora-modules \'{"name": ..., "path": ..., "is_3d_lora_weight": true}\', which this '
            "deployment does not set: retrain with LoRA on the attention projections only (lora.target_modules "
            "without `experts`), or merge the adapter and serve the merged model"
        ]
    missing = sorted(t for t in EXPERT_TENSORS if not any(f.endswith(t) for f in fused))
    if missing:
        return [
            f"{path}: expert LoRA without {missing}: vLLM {VLLM_VERSION_CHECKED} converts fused expert adapters only "
            "with both gate_up_proj and down_proj adapted; retrain with lora.target_modules including `experts`"
        ]
    return []


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
    router = sorted(t for t in config.get("target_parameters") or () if t.split(".")[-2:-1] == ["gate"] or t == "gate")
    if router:
        return [
            f"{path}: target_parameters {router} adapt the MoE router, which vLLM has no LoRA layer for; retrain "
            "without them (the trainer keeps the router frozen)"
        ]
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
    unsupported = sorted(modules - supported - {"experts"})  # fused experts: _moe_problems
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
    moe_3d_lora_format: bool = False,
) -> list[str]:
    """Every reason vLLM would refuse the adapter in ``adapter_dir`` (empty list = servable).
    ``moe_3d_lora_format``: the server runs ``--enable-mixed-moe-lora-format`` and is given this adapter
    with ``"is_3d_lora_weight": true`` (the project's deploy step does neither)."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        return [f"{adapter_dir}: not a directory"]
    supported = frozenset(supported_target_modules)
    config, problems = _read_config(adapter_dir)
    if config is not None:
        path = adapter_dir / CONFIG_FILE
        problems += _config_problems(config, path, max_lora_rank) + _target_problems(config, path, supported)
    problems += _weights_problems(adapter_dir, supported)
    try:
        keys = safetensors_keys(adapter_dir / WEIGHTS_FILE)
    except (OSError, ValueError, struct.error):
        keys = []  # reported above
    return problems + _moe_problems(config or {}, keys, adapter_dir / WEIGHTS_FILE, moe_3d_lora_format)


def require_vllm_servable(
    adapter_dir: str | Path,
    *,
    max_lora_rank: int = 64,
    supported_target_modules: Iterable[str] = SUPPORTED_TARGET_MODULES,
    moe_3d_lora_format: bool = False,
) -> None:
    """Raise ``AdapterNotServableError`` listing every problem ``check_vllm_servable`` finds."""
    problems = check_vllm_servable(
        adapter_dir,
        max_lora_rank=max_lora_rank,
        supported_target_modules=supported_target_modules,
        moe_3d_lora_format=moe_3d_lora_format,
    )
    if problems:
        raise AdapterNotServableError(f"adapter {adapter_dir} cannot be served by vLLM:\n- " + "\n- ".join(problems))
