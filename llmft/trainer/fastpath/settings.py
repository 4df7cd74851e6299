"""A run's ``auto`` settings, resolved once: the fast path (resolve.py) and the memory plan (memory.py).

The trainer needs the micro batch before the model loads (the loader is built first) and the
fast path and checkpointed layers while it loads; :func:`run_settings` computes both from the
config, the model's ``config.json`` (no weights), the tokenized data's manifest and the GPU's
free memory at the first call, and returns the same answer to every later call for the same
(config, device, world size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from transformers import AutoConfig

from llmft.trainer.data.loader import dataset_info, resolve_global_sequences
from llmft.trainer.errors import ConfigError
from llmft.trainer.fastpath.compile import decoder_layers
from llmft.trainer.fastpath.resolve import FastPath, model_info_from_config, resolve_fast_path
from llmft.trainer.flops import ALL_LINEAR, shape_from_config
from llmft.trainer.moe_model import EXPERT_TARGETS
from llmft.trainer.sizing import memory

_SETTINGS: dict = {}
_FREE_AT_START: dict = {}


@dataclass(frozen=True)
class RunSettings:
    fast: FastPath
    memory: memory.MemoryPlan


def run_settings(cfg, device: torch.device, world_size: int | None = None) -> RunSettings:
    """The resolved fast path and memory plan of this rank (cached per config, device, world size)."""
    world = world_size or _world_size()
    key = (cfg, str(device), world)
    if key not in _SETTINGS:
        config = model_config(cfg.model)
        fast = resolve_fast_path(cfg, device, model_info_from_config(config))
        _SETTINGS[key] = RunSettings(fast, _memory_plan(cfg, device, world, config, fast))
    return _SETTINGS[key]


def micro_sequences_for(cfg, info) -> int:
    """``batch.micro_sequences`` for the loader: the configured number, or what fits (``auto``)."""
    return run_settings(cfg, info.device, info.world_size).memory.micro_sequences


def model_config(model_cfg):
    """The base model's transformers config (config.json only); a one-line ConfigError when unreadable."""
    try:
        return AutoConfig.from_pretrained(
            model_cfg.name_or_path, revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"model.name_or_path={model_cfg.name_or_path!r}: cannot read its config.json ({first}); give a local "
            "model directory or a hub id this machine can reach"
        ) from None


def free_memory_at_start(device: torch.device) -> int:
    """Free bytes on ``device`` when first asked (before this process loads anything there); with
    several ranks the smallest over all of them, so every rank plans the same micro batch (DeepSpeed
    needs one accumulation count). Every rank asks at the same point: the loader's construction."""

    key = str(device)
    if key not in _FREE_AT_START:
        free = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(free, op=dist.ReduceOp.MIN)
        _FREE_AT_START[key] = int(free.item())
    return _FREE_AT_START[key]


def memory_setup(cfg, config, fast: FastPath, world_size: int) -> memory.Setup:
    """The memory model's inputs for this config and resolved fast path."""

    targets = tuple(cfg.lora.target_modules)
    adapted = ALL_LINEAR if targets == ("all-linear",) else tuple(t for t in targets if t in ALL_LINEAR)
    return memory.Setup(
        shape=shape_from_config(config),
        method=cfg.method,
        lora_rank=cfg.lora.r,
        lora_targets=adapted,
        lora_dropout=cfg.lora.dropout,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        varlen=fast.attention not in ("sdpa", "eager"),
        fused_loss=fast.fused_loss.on,
        fused_lora=fast.fused_lora.on,
        grouped_lora=fast.grouped_lora.on,
        compile=fast.compile.on,
        zero_stage=cfg.distributed.zero_stage if cfg.distributed.backend == "deepspeed" else 0,
        world_size=world_size,
        lora_experts=any(t in EXPERT_TARGETS for t in targets),
    )


def _memory_plan(cfg, device, world: int, config, fast: FastPath) -> memory.MemoryPlan:
    micro, checkpointing = cfg.batch.micro_sequences, cfg.model.gradient_checkpointing
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if getattr(device, "type", device) != "cuda":
        return memory.cpu_plan(micro, checkpointing, layers)
    setup = memory_setup(cfg, config, fast, world)

    max_length = int(dataset_info(cfg.data)["max_length"])
    sequences = resolve_global_sequences(cfg.batch.global_sequences, cfg.batch.global_tokens, max_length)
    return memory.plan(
        setup,
        free_bytes=free_memory_at_start(device),
        max_length=max_length,
        per_rank_sequences=max(1, sequences // world),
        micro=micro,
        checkpointing=checkpointing,
    )


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def enable_checkpointing(model, layers: int) -> int:
    """Non-reentrant activation checkpointing on the first ``layers`` decoder layers (all when
    ``layers`` covers them, through transformers' own switch); returns how many layers recompute."""

    if layers <= 0:
        return 0
    blocks: list[Any] = decoder_layers(model)  # transformers' decoder layers, duck-typed
    if layers >= len(blocks) or not all(hasattr(b, "gradient_checkpointing") for b in blocks):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return len(blocks)
    for block in blocks[:layers]:  # transformers' GradientCheckpointingLayer reads these per layer
        block._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        block.gradient_checkpointing = True
    return layers
