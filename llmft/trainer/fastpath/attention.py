"""Per-document causal attention for packed rows, selectable as
``attn_implementation="llmft_varlen"`` in any transformers model that uses the
``AttentionInterface`` (Llama, Qwen2, Qwen3, Mistral, ...).

A packed row holds several documents back to back. Attention must stay inside
each document; the cumulative document boundaries (``cu_seq_lens_q``, int32,
``[0, len0, len0+len1, ...]`` over the flattened batch) and the longest
document (``max_length_q``) come in as forward keyword arguments, the same
names transformers' flash-attention path uses; :func:`packed_attention_kwargs`
builds them on the host from document lengths, so the step needs no device
sync. Without them the boundaries are derived from ``position_ids`` (which
restart at 0 per document; one host sync per layer call) and, failing that,
each row is one document.

On CUDA this calls ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's
variable-length kernel, shipped with torch >= 2.10: O(L) memory, no mask
tensor). Elsewhere (CPU tests) each document runs through
``scaled_dot_product_attention`` with ``is_causal=True``: slow, exact, and the
reference the CUDA path is checked against.

transformers builds no mask for an attention name that is not in its mask
interface, so no dense (L x L) mask is ever created for this implementation.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface

from llmft.trainer.loss import bucket_max_length

ATTENTION_NAME = "llmft_varlen"
GQA_MODES = ("repeat", "native")
"""How grouped-query attention reaches the kernel when torch's varlen_attn has no ``enable_gqa`` flag
(torch 2.11): "native" passes the Hkv key/value heads as they are (FlashAttention's varlen kernel
handles H % Hkv == 0 itself), "repeat" expands them to H heads first. Chosen when registering
(:func:`register`); llmft/benchmarks/gpu/check_kernels.py checks both against a float64 reference on the GPU."""


def register(gqa_mode: str = "repeat") -> str:
    """Register ``llmft_varlen`` with transformers' AttentionInterface; returns the name. Idempotent
    (a later call's ``gqa_mode``, one of :data:`GQA_MODES`, replaces an earlier one's)."""
    if gqa_mode not in GQA_MODES:
        raise ValueError(f"GQA mode {gqa_mode!r}: one of {GQA_MODES}")
    forward = varlen_attention_forward
    if gqa_mode != "repeat":
        forward = functools.wraps(varlen_attention_forward)(
            functools.partial(varlen_attention_forward, gqa_mode=gqa_mode)
        )
    AttentionInterface.register(ATTENTION_NAME, forward)
    return ATTENTION_NAME


def packed_attention_kwargs(doc_lengths: Sequence[int] | np.ndarray, device=None) -> dict:
    """Forward kwargs describing the documents of a packed (flattened) batch.

    ``doc_lengths`` lists every document of the batch in order, across rows
    (rows are flattened: row 1's first document follows row 0's last).
    """
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    if lengths.size == 0 or (lengths <= 0).any():
        raise ValueError(f"document lengths must be positive, got {lengths.tolist()[:8]}")
    cu = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    cu_tensor = torch.from_numpy(cu)
    if device is not None and torch.device(device).type == "cuda":
        cu_tensor = cu_tensor.pin_memory().to(device, non_blocking=True)
    elif device is not None:
        cu_tensor = cu_tensor.to(device)
    longest = bucket_max_length(int(lengths.max()))
    return {"cu_seq_lens_q": cu_tensor, "cu_seq_lens_k": cu_tensor, "max_length_q": longest, "max_length_k": longest}


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries of flattened packed rows from positions restarting at 0 (host sync)."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([torch.zeros(1, dtype=starts.dtype, device=starts.device), starts])
    end = torch.tensor([flat.numel()], dtype=starts.dtype, device=starts.device)
    return torch.cat([starts, end]).to(torch.int32)


def _read_varlen_signature() -> frozenset[str]:
    try:
        # optional: torch.nn.attention.varlen
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10: no varlen kernel (CPU reference path still works)
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


# Read once at import, outside any compiled region (Dynamo would trace through a cache wrapper).
_VARLEN_PARAMS = _read_varlen_signature()


def _cuda_varlen(q, k, v, cu, max_len: int, scale: float | None, gqa_mode: str = "repeat"):
    """q/k/v: (T, H, D). Calls torch's FlashAttention varlen kernel, causal, in bf16/fp16."""

    params = _VARLEN_PARAMS
    kwargs: dict[str, Any] = {"scale": scale}
    if "window_size" in params:  # torch >= 2.11: causal is window (-1, 0)
        kwargs["window_size"] = (-1, 0)
    else:  # torch 2.10
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif gqa_mode == "repeat":
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
    out_dtype = q.dtype
    if q.dtype not in (torch.bfloat16, torch.float16):  # fp32 activations under autocast: the kernel is 16-bit only
        half = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
        q, k, v = q.to(half), k.to(half), v.to(half)
    out = cast(torch.Tensor, varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs))  # no return_aux: one tensor
    return out.to(out_dtype)


def _reference_per_document(q, k, v, cu, scale: float | None):
    """Exact per-document causal attention, one SDPA call per document. q/k/v: (T, H, D)."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end <= start:
            continue
        qd = q[start:end].transpose(0, 1)
        kd = k[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)
        vd = v[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)
        od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
        out[start:end] = od.transpose(0, 1)
    return out


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    position_ids: torch.Tensor | None = None,
    gqa_mode: str = "repeat",
    **kwargs,
):
    """transformers attention function: query (B, H, L, D), key/value (B, Hkv, L, D) -> ((B, L, H, D), None)."""
    if dropout:
        raise ValueError(f"{ATTENTION_NAME} does not implement attention dropout (got {dropout}); set it to 0")
    if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.bool().all()):
        raise ValueError(f"{ATTENTION_NAME} expects packed rows without padding masks; pass attention_mask=None")
    if kwargs.get("past_key_values") is not None or kwargs.get("sliding_window"):
        raise ValueError(f"{ATTENTION_NAME} supports training forwards only (no KV cache, no sliding window)")
    batch, heads, length, dim = query.shape
    q = query.transpose(1, 2).reshape(batch * length, heads, dim)
    k = key.transpose(1, 2).reshape(batch * length, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(batch * length, value.shape[1], dim)
    cu = cu_seq_lens_q
    if cu is None:
        if position_ids is not None:  # may be (1, L) broadcast over the batch
            cu = cu_seqlens_from_position_ids(position_ids.expand(batch, length))
        else:
            cu = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=q.device)
    cu = cu.to(device=q.device, dtype=torch.int32)
    if q.is_cuda:
        max_len = int(max_length_q) if max_length_q is not None else bucket_max_length(length)
        out = _cuda_varlen(q, k, v, cu, max_len, scaling, gqa_mode)
    else:
        out = _reference_per_document(q, k, v, cu, scaling)
    return out.reshape(batch, length, heads, dim), None
