"""FP8 checkpoint formats: recognise them from ``config.json`` and dequantize their stored weights.

Two FP8 formats are read:

* transformers' fine-grained FP8 (``FineGrainedFP8Config``; ``config.json`` has
  ``quantization_config.quant_method == "fp8"`` and ``weight_block_size``): every quantized
  ``<module>.weight`` is ``float8_e4m3fn`` beside a float32 ``<module>.weight_scale_inv`` with one
  value per ``weight_block_size`` block, and ``W = q * weight_scale_inv`` block by block
  (transformers ``integrations/finegrained_fp8.py``: ``Fp8Quantize._quantize_one`` stores the inverse
  scale ``max|block| / 448``, ``Fp8Dequantize._dequantize_one`` multiplies it back). This is the
  format of the DeepSeek-V3 and Qwen3 ``-FP8`` releases.
* compressed-tensors' float-quantized FP8 (``quant_method == "compressed-tensors"``): ``<module>.weight``
  in FP8 beside a multiplicative ``<module>.weight_scale`` (per tensor, per output channel or per
  block). transformers loads it only with the ``compressed-tensors`` package installed.

The bottom of the weight readers: llmft/trainer/merge.py (streaming rewrites) and llmft/trainer/fp8.py (loading
a base for training) both import it; it imports neither.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmft.trainer.errors import ConfigError

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
FINEGRAINED = "fp8"
COMPRESSED = "compressed-tensors"
SCALE_NAMES = {FINEGRAINED: "weight_scale_inv", COMPRESSED: "weight_scale"}
"""The tensor beside ``<module>.weight`` that holds its (multiplicative) dequantization scale."""
DROPPED_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale", ".weight_zero_point", ".activation_scale")
"""Quantization side tensors; a dequantized (dense) checkpoint carries none of them."""


@dataclass(frozen=True)
class BaseFormat:
    """How the base model was loaded: its storage format and what loading did (llmft/trainer/fp8.py
    ``load_plan``), for the ``base model:`` log line and the run manifest's ``base_format``."""

    format: str
    """e.g. ``dense``, ``FP8 (fine-grained, block [128, 128])``, ``FP8 (compressed-tensors)``."""
    action: str
    """e.g. ``loaded as stored``, ``dequantized to bfloat16 on load``."""
    dequantized_copy: str | None = None
    """QLoRA over an FP8 base: the bf16 copy that was loaded and re-quantized to 4-bit."""

    def as_dict(self) -> dict[str, str]:
        out = {"format": self.format, "action": self.action}
        if self.dequantized_copy is not None:
            out["dequantized_copy"] = self.dequantized_copy
        return out


@dataclass(frozen=True)
class QuantFormat:
    """What ``config.json``'s ``quantization_config`` says about the stored weights."""

    method: str | None
    """None (dense), ``fp8``, ``compressed-tensors`` or another quantization method."""
    block: tuple[int, int] | None = None
    """FP8 weight block size (rows, cols); None for per-tensor or per-channel scales."""
    config: dict = field(default_factory=dict)
    """The raw quantization_config."""

    @property
    def is_fp8(self) -> bool:
        return self.method in (FINEGRAINED, COMPRESSED)

    @property
    def scale_name(self) -> str | None:
        return SCALE_NAMES.get(self.method or "")

    def describe(self) -> str:
        if self.method is None:
            return "dense"
        block = f", block {list(self.block)}" if self.block else ""
        return {FINEGRAINED: f"FP8 (fine-grained{block})", COMPRESSED: f"FP8 (compressed-tensors{block})"}.get(
            self.method, f"quantized ({self.method})"
        )


def quant_format(config: dict) -> QuantFormat:
    """The storage format named by a model's ``config.json`` (a dict)."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return QuantFormat(None)
    method = str(qc.get("quant_method", "")).lower()
    if method == FINEGRAINED:
        block = qc.get("weight_block_size")
        return QuantFormat(FINEGRAINED, tuple(block) if block else None, dict(qc))
    if method == COMPRESSED:
        return QuantFormat(COMPRESSED if _compressed_is_fp8(qc) else "compressed-tensors (not FP8)", _ct_block(qc), qc)
    return QuantFormat(method or "unknown", None, dict(qc))


def _compressed_is_fp8(qc: dict) -> bool:
    """Every config group quantizes weights to 8-bit floats, stored float- or naive-quantized."""
    groups = (qc.get("config_groups") or {}).values()
    weights = [g.get("weights") or {} for g in groups]
    fmt = str(qc.get("format", "")).lower()
    return (
        bool(weights)
        and fmt in ("float-quantized", "naive-quantized")
        and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights)
    )


def _ct_block(qc: dict) -> tuple[int, int] | None:
    for group in (qc.get("config_groups") or {}).values():
        block = (group.get("weights") or {}).get("block_structure")
        if block:
            return tuple(block)
    return None


def read_model_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing; a Hugging Face model directory needs config.json") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


# ----------------------------------------------------------------------------- dequantization


def block_shape(weight_shape, scale_shape, block: tuple[int, int] | None) -> tuple[int, int]:
    """(rows, cols) of the block each scale value covers.

    The configured block wins when the scale grid is ``ceil(rows / b0) x ceil(cols / b1)`` (edge
    blocks may be partial, as DeepSeek-V3's ``weight_dequant`` allows); otherwise the grid must divide
    the weight evenly (per-channel ``[rows, 1]`` scales, or a block size not recorded)."""
    rows, cols = weight_shape[-2:]
    grid_r, grid_c = scale_shape[-2:]
    if block and math.ceil(rows / block[0]) == grid_r and math.ceil(cols / block[1]) == grid_c:
        return int(block[0]), int(block[1])
    if rows % grid_r or cols % grid_c:
        raise ValueError(f"weight {tuple(weight_shape)} does not tile into a {grid_r} x {grid_c} scale grid")
    return rows // grid_r, cols // grid_c


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None = None,
    dtype=torch.float32,
    *,
    in_scale_dtype: bool = False,
) -> torch.Tensor:
    """``q * scale`` with each scale value spread over its block, cast to ``dtype``.

    The product is float32, as transformers' ``Fp8Dequantize._dequantize_one`` computes it (ue8m0
    scales stored as uint8 are ``2 ** (byte - 127)`` there too); ``in_scale_dtype`` computes it in
    the scale's dtype instead, as compressed-tensors' ``_dequantize`` does
    (``quantization/lifecycle/forward_helpers.py``)."""
    compute = scale.dtype if in_scale_dtype and scale.dtype.is_floating_point else torch.float32
    values = q.to(compute)
    s = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(compute)
    if s.numel() == 1:
        return (values * s.reshape(())).to(dtype)
    if s.ndim == 1:  # one scale per output row
        s = s.reshape(-1, 1)
    bm, bn = block_shape(values.shape, s.shape, block)
    rows, cols = values.shape[-2:]
    full = s.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)[..., :rows, :cols]
    return (values * full).to(dtype)


def dequantize_stored(q: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat, dtype=torch.float32) -> torch.Tensor:
    """Dequantize one stored weight with the arithmetic of the library that reads ``fmt``."""
    return dequantize(q, scale, fmt.block, dtype, in_scale_dtype=fmt.method == COMPRESSED)


def is_side_tensor(name: str) -> bool:
    """A quantization scale / zero point, dropped from a dense checkpoint."""
    return name.endswith(DROPPED_SUFFIXES)


def scale_name_for(weight_name: str, fmt: QuantFormat) -> str | None:
    if not fmt.is_fp8 or fmt.scale_name is None or not weight_name.endswith(".weight"):
        return None
    return weight_name[: -len("weight")] + fmt.scale_name
