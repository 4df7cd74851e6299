"""Which fast pieces a run uses: the ``auto`` settings resolved for this device, method and model.

:func:`resolve_fast_path` is pure (no weights, no GPU): from the config, the device type and a
:class:`ModelInfo` read from the model's ``config.json`` it decides, per piece, on or off and why.

- On CUDA, ``auto`` switches on every piece that applies: per-document varlen attention
  (``llmft_varlen``), the fused loss, fused and grouped LoRA linears, compiled decoder layers.
- On CPU, ``auto`` leaves every piece off: the run is the plain path it always was.
- A piece that does not apply stays off with the reason (``"DoRA: not applicable"``); fused LoRA is
  also decided per module when it is applied (a module it cannot reproduce keeps PEFT's layer and
  the rest is fused). QLoRA takes every piece: its 4-bit projections run the fused LoRA path with
  the weight dequantized inside (qlora.py), grouped where siblings share a quantization layout.
- An explicit ``true``/``false`` wins; ``true`` where the piece cannot apply is a one-line
  :class:`~llmft.trainer.errors.ConfigError` before any weights load.

:meth:`FastPath.applied` adds what applying the decisions did (modules fused, layers compiled) and
the memory plan; ``trainer.model.load_model`` returns that typed decision beside the model.
:meth:`FastPath.as_dict` is its plain form ``{piece: {"on": bool, "why": str, ...}}``, written to
metrics.jsonl and to final/training_manifest.json; :func:`describe` is its one ``fast path:`` log line.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from llmft.trainer.errors import ConfigError
from llmft.trainer.fastpath.attention import _VARLEN_PARAMS

if TYPE_CHECKING:
    from llmft.trainer.fp8_format import BaseFormat
    from llmft.trainer.sizing.memory import MemoryPlan

VARLEN = "llmft_varlen"
PIECES = ("fused_loss", "fused_lora", "grouped_lora", "compile")


@dataclass(frozen=True)
class ModelInfo:
    """What the resolution needs to know about the base model (from its config; no weights)."""

    attention_interface: bool = True  # attention goes through transformers' AttentionInterface
    sliding_window: bool = False
    attention_dropout: float = 0.0
    decoder_layers: bool = True  # the model's code defines *DecoderLayer modules (what compile wraps)
    head_bias: bool = False


# What a piece's count counts, and the name of the modules it left out, in the written report.
_UNITS: dict[str, tuple[str, str | None]] = {
    "fused_lora": ("modules", "kept"),
    "grouped_lora": ("groups", "ungrouped"),
    "compile": ("layers", None),
    "gradient_checkpointing": ("layers", None),
}


@dataclass(frozen=True)
class Piece:
    """One piece on or off, why, and (once applied) how many modules took it and which did not, why."""

    on: bool
    why: str
    count: int | None = None
    left_out: Mapping[str, str] | None = None

    def as_dict(self, name: str = "") -> dict:
        out: dict[str, Any] = {"on": self.on, "why": self.why}
        unit, left_out = _UNITS.get(name, ("count", "left_out"))
        if self.count is not None:
            out[unit] = self.count
            if left_out is not None:
                out[left_out] = dict(self.left_out or {})
        return out


@dataclass(frozen=True)
class FastPath:
    """The fast-path decision: attention implementation plus one :class:`Piece` per kernel, each on or
    off with why; once applied (:meth:`applied`), what applying did, the memory plan and MoE's report."""

    attention: str
    attention_why: str
    fused_loss: Piece
    fused_lora: Piece
    grouped_lora: Piece
    compile: Piece
    memory: MemoryPlan | None = None
    """The micro batch and checkpointed layers (trainer.sizing.memory), as applied."""
    moe: Mapping[str, Any] | None = None
    """What trainer.fastpath.moe.apply_moe did on an MoE model (frozen routers, grouped experts)."""
    base: BaseFormat | None = None
    """How the base weights were loaded (llmft/trainer/fp8.py: as stored, or an FP8 base dequantized); not a speed
    piece, so not in :meth:`as_dict`: the run manifest records it as ``base_format``."""

    @property
    def varlen(self) -> bool:
        return self.attention == VARLEN

    @property
    def gradient_checkpointing(self) -> Piece | None:
        if self.memory is None:
            return None
        layers = self.memory.checkpointed_layers
        return Piece(layers > 0, self.memory.checkpointing_why, count=layers)

    def applied(self, done: Mapping[str, Any], memory: MemoryPlan | None = None) -> FastPath:
        """This decision plus what :func:`llmft.trainer.fastpath.apply_kernels` returned (``done``: modules
        fused, kept on PEFT with their reasons, groups, compiled layers) and the memory plan as applied.
        Fused LoRA that no module could take, or grouping that formed no group, turns off with the reason."""
        lora, grouped, compiled = self.fused_lora, self.grouped_lora, self.compile
        if lora.on:
            kept = dict(done.get("lora_kept", {}))
            lora = replace(lora, count=done.get("fused_lora", 0), left_out=kept)
            if not lora.count:
                reasons = sorted(set(kept.values())) or ["no LoRA linear in the model"]
                lora = replace(lora, on=False, why=f"no LoRA linear could take it ({reasons[0]})")
        if grouped.on:
            grouped = replace(grouped, count=done.get("grouped_lora", 0), left_out=dict(done.get("lora_ungrouped", {})))
            if not grouped.count:
                grouped = replace(grouped, on=False, why="no q/k/v or gate/up siblings all fused")
        if compiled.on:
            compiled = replace(compiled, count=done.get("compiled_layers", 0))
        return replace(self, fused_lora=lora, grouped_lora=grouped, compile=compiled, memory=memory)

    def as_dict(self) -> dict:
        """The plain form written to metrics.jsonl and final/training_manifest.json."""
        report: dict[str, Any] = {
            "attention": {"on": self.varlen, "value": self.attention, "why": self.attention_why},
            **{name: getattr(self, name).as_dict(name) for name in PIECES},
        }
        if self.memory is not None:
            report["gradient_checkpointing"] = self.gradient_checkpointing.as_dict("gradient_checkpointing")  # type: ignore[union-attr]
            report["micro_batch"] = {"sequences": self.memory.micro_sequences, "why": self.memory.micro_why}
            report["memory"] = {
                k: getattr(self.memory, k) for k in ("estimate_gib", "budget_gib", "free_gib", "parts_gib")
            }
        if self.moe is not None:
            report["moe"] = dict(self.moe)
        return report


def model_info_from_config(config) -> ModelInfo:
    """Read a :class:`ModelInfo` from a transformers config (``AutoConfig.from_pretrained``)."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = "sliding_attention" in layer_types or (
        not layer_types
        and bool(getattr(config, "sliding_window", None))
        and getattr(config, "use_sliding_window", True)
    )
    cls = _model_class(config)
    module = sys.modules.get(cls.__module__) if cls is not None else None
    return ModelInfo(
        attention_interface=bool(getattr(cls, "_supports_attention_backend", cls is None)),
        sliding_window=sliding,
        attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        decoder_layers=module is None or any(name.endswith("DecoderLayer") for name in vars(module)),
        head_bias=bool(getattr(config, "lm_head_bias", False)),
    )


def _model_class(config):
    try:
        # heavy: transformers
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM._model_mapping[type(config)]
    except (ImportError, KeyError, ValueError):
        return None  # remote code or an unknown architecture: assume the common case, let loading tell


def varlen_unsupported(info: ModelInfo) -> str | None:
    """Why ``llmft_varlen`` cannot run this model, or None."""

    if not info.attention_interface:
        return "the model class does not use transformers' AttentionInterface"
    if info.sliding_window:
        return "sliding-window attention layers"
    if info.attention_dropout > 0:
        return f"attention dropout {info.attention_dropout} > 0"
    if not _VARLEN_PARAMS:
        return f"torch {torch.__version__} has no varlen_attn (needs >= 2.10)"
    return None


def resolve_fast_path(cfg, device, info: ModelInfo) -> FastPath:
    """Decide every piece (see the module doc). Raises ConfigError for ``true`` where it cannot apply."""
    cuda = getattr(device, "type", device) == "cuda"
    zero3 = cfg.distributed.backend == "deepspeed" and cfg.distributed.zero_stage == 3
    attention, attention_why = _attention(cfg.model.attn_implementation, cuda, info)
    fused_loss = _piece("kernels.fused_loss", cfg.kernels.fused_loss, cuda, _loss_blocker(cfg, info))
    fused_lora = _piece("kernels.fused_lora", cfg.kernels.fused_lora, cuda, _lora_blocker(cfg, zero3))
    # grouped LoRA is part of fused LoRA: auto follows it (also where fused_lora=true runs on CPU)
    grouped_blocker = None if fused_lora.on else "needs kernels.fused_lora"
    grouped = _piece("kernels.grouped_lora", cfg.kernels.grouped_lora, cuda or fused_lora.on, grouped_blocker)
    compile_blocker = "no *DecoderLayer modules to compile" if not info.decoder_layers else None
    compile_piece = _piece("kernels.compile", cfg.kernels.compile, cuda, compile_blocker)
    if zero3 and cfg.kernels.compile == "auto" and compile_piece.on:
        compile_piece = Piece(False, "DeepSpeed ZeRO-3 gathers weights in module hooks: not measured compiled")
    return FastPath(attention, attention_why, fused_loss, fused_lora, grouped, compile_piece)


def _attention(setting: str, cuda: bool, info: ModelInfo) -> tuple[str, str]:
    if setting != "auto":
        blocker = varlen_unsupported(info) if setting == VARLEN else None
        if blocker is not None:
            raise ConfigError(f"model.attn_implementation={VARLEN}: {blocker}; use auto or sdpa")
        return setting, "set by model.attn_implementation"
    if not cuda:
        return "sdpa", "cpu"
    blocker = varlen_unsupported(info)
    return ("sdpa", blocker) if blocker else (VARLEN, "auto")


def _piece(key: str, setting, cuda: bool, blocker: str | None) -> Piece:
    if setting is False:
        return Piece(False, "set false")
    if setting == "auto" and not cuda:
        return Piece(False, "cpu")
    if blocker is not None:
        if setting is True:
            raise ConfigError(f"{key}=true: {blocker}; set it to auto or false")
        return Piece(False, blocker)
    return Piece(True, "set true" if setting is True else "auto")


def _loss_blocker(cfg, info: ModelInfo) -> str | None:
    if cfg.method != "full" and "lm_head" in cfg.lora.target_modules:
        return "lm_head carries a LoRA adapter: not applicable"
    if info.head_bias:
        return "lm_head has a bias: not applicable"
    return None


def _lora_blocker(cfg, zero3: bool) -> str | None:
    if cfg.method == "full":
        return "method full: no LoRA layers"
    if cfg.lora.use_dora:
        return "DoRA: not applicable"
    if zero3:
        return "DeepSpeed ZeRO-3 partitions the base weights: not applicable"
    return None


# ----------------------------------------------------------------------------- the report


def describe(fast: FastPath) -> str:
    """One log line: ``fast path: on: ...; off: piece (why), ...; micro batch: ...; memory: ...``
    (keys it does not know, e.g. ``moe``, are appended as they are). No ``name=value`` pairs: Katib's
    stdout metrics collector would read them as metrics."""
    report = fast.as_dict()
    on: list[str] = []
    off: list[str] = []
    other: list[str] = []
    for name, value in report.items():
        if name in ("micro_batch", "memory"):
            continue
        if not isinstance(value, dict) or "on" not in value:
            if value not in ({}, None):
                other.append(f"{name} {value}")
            continue
        label = _label(name, value)
        (on if value["on"] else off).append(label if value["on"] else f"{label} ({value['why']})")
    parts = [f"on: {', '.join(on) or 'nothing'}"] + ([f"off: {', '.join(off)}"] if off else [])
    micro = report.get("micro_batch")
    if micro:
        parts.append(f"micro batch: {micro['sequences']} sequence(s) ({micro['why']})")
    memory = report.get("memory") or {}
    if memory.get("estimate_gib") is not None:
        parts.append(f"memory: est. {memory['estimate_gib']} of {memory['budget_gib']} GiB usable")
    return "fast path: " + "; ".join(parts + other)


def _label(name: str, value: dict) -> str:
    if name == "attention":
        return f"attention {value['value']}"
    unit = {"fused_lora": "modules", "grouped_lora": "groups", "compile": "layers", "gradient_checkpointing": "layers"}
    if value["on"] and unit.get(name) in value:
        return f"{name} ({value[unit[name]]} {unit[name]})"
    return name
