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

:func:`fast_path_report` turns the decisions (plus what applying them did, and the memory plan)
into the plain dict the model carries as ``model.llmft_fastpath``: ``{piece: {"on": bool,
"why": str, ...}}``, logged as one ``fast path:`` line (:func:`describe`), written to
metrics.jsonl and to final/training_manifest.json.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from llmft.trainer.errors import ConfigError

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


@dataclass(frozen=True)
class Piece:
    on: bool
    why: str

    def as_dict(self) -> dict:
        return {"on": self.on, "why": self.why}


@dataclass(frozen=True)
class FastPath:
    """The resolved settings: attention implementation plus one :class:`Piece` per kernel."""

    attention: str
    attention_why: str
    fused_loss: Piece
    fused_lora: Piece
    grouped_lora: Piece
    compile: Piece

    @property
    def varlen(self) -> bool:
        return self.attention == VARLEN


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
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM._model_mapping[type(config)]
    except (ImportError, KeyError, ValueError):
        return None  # remote code or an unknown architecture: assume the common case, let loading tell


def varlen_unsupported(info: ModelInfo) -> str | None:
    """Why ``llmft_varlen`` cannot run this model, or None."""
    from llmft.trainer.fastpath.attention import _VARLEN_PARAMS

    if not info.attention_interface:
        return "the model class does not use transformers' AttentionInterface"
    if info.sliding_window:
        return "sliding-window attention layers"
    if info.attention_dropout > 0:
        return f"attention dropout {info.attention_dropout} > 0"
    if not _VARLEN_PARAMS:
        import torch

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


def fast_path_report(fast: FastPath, applied: dict, memory: dict | None = None) -> dict:
    """The plain dict of ``model.llmft_fastpath``: every piece on/off with why, what applying did.

    ``applied`` is what :func:`llmft.trainer.fastpath.apply_kernels` returned (modules fused, kept
    on PEFT with their reasons, groups, compiled layers); ``memory`` the memory plan's dict.
    """
    lora = fast.fused_lora.as_dict()
    if fast.fused_lora.on:
        lora.update(modules=applied.get("fused_lora", 0), kept=applied.get("lora_kept", {}))
        if not lora["modules"]:
            reasons = sorted(set(lora["kept"].values())) or ["no LoRA linear in the model"]
            lora.update(on=False, why=f"no LoRA linear could take it ({reasons[0]})")
    grouped = fast.grouped_lora.as_dict()
    if fast.grouped_lora.on:
        grouped.update(groups=applied.get("grouped_lora", 0), ungrouped=applied.get("lora_ungrouped", {}))
        if not grouped["groups"]:
            grouped.update(on=False, why="no q/k/v or gate/up siblings all fused")
    compiled = fast.compile.as_dict()
    if fast.compile.on:
        compiled["layers"] = applied.get("compiled_layers", 0)
    report = {
        "attention": {"on": fast.varlen, "value": fast.attention, "why": fast.attention_why},
        "fused_loss": fast.fused_loss.as_dict(),
        "fused_lora": lora,
        "grouped_lora": grouped,
        "compile": compiled,
    }
    if memory:
        report["gradient_checkpointing"] = {
            "on": memory["checkpointed_layers"] > 0,
            "why": memory["checkpointing_why"],
            "layers": memory["checkpointed_layers"],
        }
        report["micro_batch"] = {"sequences": memory["micro_sequences"], "why": memory["micro_why"]}
        report["memory"] = {k: memory[k] for k in ("estimate_gib", "budget_gib", "free_gib", "parts_gib")}
    return report


def describe(report: dict) -> str:
    """One log line: ``fast path: on: ...; off: piece (why), ...; micro batch: ...; memory: ...``
    (keys it does not know, e.g. ``moe``, are appended as they are). No ``name=value`` pairs: Katib's
    stdout metrics collector would read them as metrics."""
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
