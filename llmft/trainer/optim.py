"""Optimizer and learning-rate schedule.

AdamW over the trainable parameters (weight decay on matrices only), fused when
the device supports it: the fused kernel reads ``optimizer.found_inf`` and skips
a non-finite update on the device, so no host sync is needed per step. The
schedule is linear warmup then cosine, linear or constant decay to
``min_lr_ratio`` of the peak, as a multiplier on the peak learning rate.
"""

from __future__ import annotations

import math

import torch

from llmft.trainer.config import OptimConfig, ScheduleConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; never biases or norm weights."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def fused_supported(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu")


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    fused = cfg.fused and fused_supported(device)
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
        foreach=None if fused else True,
    )


def warmup_steps(cfg: ScheduleConfig, total_steps: int) -> int:
    if cfg.warmup_steps > 0:
        return min(cfg.warmup_steps, total_steps)
    return int(round(cfg.warmup_ratio * total_steps))


def lr_multiplier(step: int, *, total_steps: int, warmup: int, decay: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR used for optimizer update number ``step + 1`` (``step`` 0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total_steps <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(optimizer, cfg: ScheduleConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warm = warmup_steps(cfg, total_steps)

    def multiplier(step: int) -> float:
        return lr_multiplier(step, total_steps=total_steps, warmup=warm, decay=cfg.decay, min_lr_ratio=cfg.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient 2-norm (device tensor), clipping to ``max_norm`` when it is > 0.
    A non-finite norm is returned as is (the caller skips that update)."""
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, foreach=True)
