"""Checks of a loaded :class:`~llmft.trainer.config.TrainConfig`: every value in range, no NaN or
infinity, closed choices, and the combinations that cannot work. The loader
(:func:`~llmft.trainer.config_load.load_config_checked`) already refused unknown keys and wrong types, and
calls :func:`validate` once per load."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from llmft.trainer.errors import ConfigError


def validate(cfg: Any, where=lambda key: "config") -> list[str]:
    """Raise ConfigError on an invalid value or combination of ``cfg`` (a TrainConfig); return warnings
    to log. llmft/trainer/config_load.py imports this module (its loader validates once), so this one reads the
    tree by attribute and never imports it back (no import cycle)."""
    _check_choices(cfg, "", where)
    _check_finite(cfg, "", where)
    checks = [
        ("model.name_or_path", bool(cfg.model.name_or_path), "is required (a hub id or a local model directory)"),
        ("data", bool(cfg.data), "is required (a directory written by `llmft data tokenize`)"),
        ("output_dir", bool(cfg.output_dir), "is required"),
        ("lora.r", cfg.lora.r > 0, "must be > 0"),
        ("lora.alpha", cfg.lora.alpha > 0, "must be > 0"),
        ("lora.dropout", 0.0 <= cfg.lora.dropout < 1.0, "must be in [0, 1)"),
        ("lora.target_modules", len(cfg.lora.target_modules) > 0, "must name at least one module (or all-linear)"),
        ("optim.lr", cfg.optim.lr > 0, "must be > 0"),
        ("optim.weight_decay", cfg.optim.weight_decay >= 0, "must be >= 0"),
        ("optim.beta1", 0.0 <= cfg.optim.beta1 < 1.0, "must be in [0, 1)"),
        ("optim.beta2", 0.0 <= cfg.optim.beta2 < 1.0, "must be in [0, 1)"),
        ("optim.eps", cfg.optim.eps > 0, "must be > 0"),
        ("optim.max_grad_norm", cfg.optim.max_grad_norm >= 0, "must be >= 0 (0 disables clipping)"),
        ("schedule.warmup_ratio", 0.0 <= cfg.schedule.warmup_ratio < 1.0, "must be in [0, 1)"),
        ("schedule.warmup_steps", cfg.schedule.warmup_steps >= 0, "must be >= 0"),
        ("schedule.min_lr_ratio", 0.0 <= cfg.schedule.min_lr_ratio <= 1.0, "must be in [0, 1]"),
        (
            "batch.global_sequences",
            cfg.batch.global_sequences > 0 or cfg.batch.global_tokens > 0,
            "or batch.global_tokens must be > 0",
        ),
        ("batch.global_tokens", cfg.batch.global_tokens >= 0, "must be >= 0"),
        (
            "batch.micro_sequences",
            cfg.batch.micro_sequences == "auto" or cfg.batch.micro_sequences >= 1,
            "must be >= 1",
        ),
        ("eval.micro_sequences", cfg.eval.micro_sequences >= 1, "must be >= 1"),
        ("max_steps", cfg.max_steps >= 0, "must be >= 0"),
        ("epochs", cfg.max_steps > 0 or cfg.epochs > 0, "must be > 0 when max_steps is 0"),
        ("eval_every", _every_ok(cfg.eval_every), _EVERY),
        ("save_every", _every_ok(cfg.save_every), _EVERY),
        ("log_every", cfg.log_every >= 1, "must be >= 1"),
        ("keep_last", cfg.keep_last >= 1, "must be >= 1"),
        ("gc_every", cfg.gc_every >= 0, "must be >= 0"),
        ("distributed.bucket_cap_mb", cfg.distributed.bucket_cap_mb >= 1, "must be >= 1"),
        (
            "distributed.grad_reduce_dtype",
            cfg.distributed.grad_reduce_dtype == "fp32" or cfg.distributed.backend == "ddp",
            "applies to backend=ddp only (DeepSpeed sets its own communication dtype); leave it at fp32",
        ),
        ("max_bad_steps", cfg.max_bad_steps >= 1, "must be >= 1"),
        ("max_restarts_without_progress", cfg.max_restarts_without_progress >= 0, "must be >= 0 (0 = no limit)"),
        ("resume", cfg.resume in ("auto", "never") or bool(cfg.resume), "must be auto, never or a checkpoint path"),
    ]
    for key, ok, message in checks:
        if not ok:
            raise ConfigError(f"{where(key)}: `{key}` {message}")
    warnings = []
    if cfg.method != "full" and cfg.lora.use_dora:
        warnings.append(
            "lora.use_dora=true: vLLM cannot serve DoRA adapters as LoRA modules, so the pipeline serves this adapter "
            "merged into its base (serving_mode=auto; llmft export --merge by hand), a full copy of the weights; "
            "train with use_dora=false to serve it as a LoRA module"
        )
    if (
        cfg.method == "qlora"
        and cfg.distributed.backend == "deepspeed"
        and cfg.distributed.zero_stage == 3
        and cfg.qlora.quant_storage == "uint8"
    ):
        raise ConfigError(
            f"{where('qlora.quant_storage')}: ZeRO-3 cannot shard uint8-packed 4-bit weights; "
            "set qlora.quant_storage=bfloat16"
        )
    return warnings


def _check_finite(cfg, prefix: str, where) -> None:
    """No NaN or infinity anywhere (``optim.lr=.inf`` parses as a float)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, prefix + f.name + ".", where)
        elif isinstance(value, float) and not math.isfinite(value):
            key = prefix + f.name
            raise ConfigError(f"{where(key)}: `{key}` is {value}; it must be a finite number")


def _check_choices(cfg, prefix: str, where) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, prefix + f.name + ".", where)
        elif f.metadata.get("choices") and value not in f.metadata["choices"]:
            key = prefix + f.name
            allowed = ", ".join(map(str, f.metadata["choices"]))
            raise ConfigError(f"{where(key)}: `{key}` is {value!r}; allowed values: {allowed}")


_EVERY = "must be 0, a fraction of the run in (0, 1), or a whole number of steps >= 1"


def _every_ok(value: float) -> bool:
    return value == 0 or 0 < value < 1 or (value >= 1 and float(value).is_integer())
