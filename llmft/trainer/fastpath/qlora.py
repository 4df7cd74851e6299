"""Fused LoRA over a 4-bit base (QLoRA): ``y = x W^T + b + s (drop(x) A^T) B^T`` with W stored in
bitsandbytes' NF4/FP4 blocks, computed in the activations' dtype (bf16) end to end.

Where PEFT's QLoRA spends its memory (float32 [tokens, 8960] buffers at 15.6k tokens on an H100);
line numbers are peft 0.21.2 and bitsandbytes 0.50.2:

- ``peft.prepare_model_for_kbit_training`` casts every bf16 parameter that is not 4-bit (embeddings,
  norms, lm_head) to float32 (``peft/utils/other.py`` 204-209); transformers' RMSNorm returns
  ``weight * hidden.to(input_dtype)``, so from the embeddings on every activation is float32.
  llmft/trainer/model.py no longer calls it (the base is only frozen).
- bitsandbytes' ``Linear4bit.forward`` (``nn/modules.py`` 609-637) casts the input to the compute
  dtype (628) and the product back to the input's dtype (637): a float32 input gives a float32
  [tokens, d_out] output.
- PEFT's ``lora.Linear4bit.forward`` (``peft/tuners/lora/bnb.py`` 513-552) clones that output (533),
  casts ``x`` to the adapter's float32 (546), computes ``lora_B(lora_A(dropout(x))) * scaling`` in
  float32 (549) and adds it (552): more float32 [tokens, d_out] tensors, which compiled layers keep
  for the backward (gate/up: 8960 wide), with the SiLU product and down_proj's input after them.
- bitsandbytes' matmul itself keeps no activation: ``MatMul4Bit`` saves only the packed weight
  (``autograd/_functions.py`` 358) and dequantizes again in the backward (384). For more than 1,536
  rows its CUDA ``gemm_4bit`` dequantizes and calls ``F.linear`` (``backends/cuda/ops.py`` 926,
  ``_dequant_linear_fallback`` 904): its own fused 4-bit kernel wins only at inference batch sizes.

This path: the base product comes from the weight dequantized to bf16 (``bitsandbytes::dequantize_4bit``)
and one cuBLAS bf16 matmul with fp32 accumulation, the same choice bitsandbytes makes past 1,536 rows.
At training token counts the matmul is compute-bound: a Qwen2.5-1.5B layer's 47M base weights cost
about 0.12 GB of memory traffic per dequantization (4-bit read, bf16 written; ~40 us at an H100's
3.35 TB/s), twice per step plus the concat form's copy, against ~5 ms of that layer's matmuls at 16k
tokens: a few percent. The adapter runs as in lora.py (bf16 matmuls, fp32 master weights and
gradients, PEFT-semantics dropout), folded into the base matmul's K (concat form) where d_out > d_in,
else added in the matmul's epilogue; grouped siblings (q/k/v, gate/up) dequantize into one stacked
weight and run one matmul.

The dequantization and the matmuls that read the weight live inside two custom ops
(``llmft::lora4bit_forward``, ``llmft::lora4bit_input_grad``), opaque to torch.compile: the
dequantized weight exists only inside them. Traced instead, AOTAutograd's CSE merges the forward's
and the backward's dequantization and the partitioner saves the dequantized weight for the backward
(seen with torch 2.13's aot_eager: a [96, 64] weight saved), 2 bytes per base parameter for the
whole step. The node keeps what the bf16 fused path keeps: its bf16 input, the rank-r ``h`` and the
dropout masks; nothing of size [tokens, d_out].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmft.trainer.fastpath.lora_dropout import drop_input, redrop
from llmft.trainer.fastpath.lora_dropout import spans as block_spans

_DEQUANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what bitsandbytes dequantizes to


@dataclass(frozen=True)
class Layout:
    """What must match for 4-bit siblings to share one dequantized, stacked weight."""

    in_features: int
    blocksize: int
    quant_type: str
    nested_blocksize: int  # blocksize of the double-quantized constants; 0 without double quantization
    storage: torch.dtype


def quant_state(base):
    """The bitsandbytes QuantState of a 4-bit linear layer (``Linear4bit``), else None."""
    return getattr(getattr(base, "weight", None), "quant_state", None)


def is_4bit(base) -> bool:
    return quant_state(base) is not None


def why_not_4bit(base) -> str | None:
    """None when this fused path reproduces the 4-bit linear ``base``, else the reason."""
    state = quant_state(base)
    if state is None:
        return f"base layer is {type(base).__name__}, not nn.Linear or a 4-bit Linear4bit"
    if getattr(state, "packing_format_for_cpu", False):
        return "4-bit weight repacked for CPU inference"
    if state.quant_type not in ("nf4", "fp4"):
        return f"4-bit quant type {state.quant_type!r}"
    shape = tuple(state.shape)
    if shape != (base.out_features, base.in_features):
        return f"4-bit weight quantized as {list(shape)}, not [out_features, in_features]"
    return None


def layout(base) -> Layout:
    state = quant_state(base)
    nested = state.state2.blocksize if state.nested else 0
    return Layout(int(state.shape[1]), int(state.blocksize), state.quant_type, int(nested), base.weight.dtype)


def out_features(base) -> int:
    """Output width of a plain or 4-bit linear (a 4-bit weight is stored packed, not [out, in])."""
    state = quant_state(base)
    return int(state.shape[0]) if state is not None else int(base.weight.shape[0])


# ----------------------------------------------------------------------------- dequantization


def _dequantize(packed, absmax, absmax2, code2, offset, rows, cols, spec, dtype, out=None) -> torch.Tensor:
    """One weight [rows, cols] in ``dtype`` (bitsandbytes.functional.dequantize_4bit's steps)."""
    blocksize, blocksize2, quant_type = spec
    if absmax2 is not None:  # double quantization: the block constants are 8-bit blocks themselves
        absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(absmax, absmax2, code2, blocksize2, torch.float32)
        absmax = absmax + offset
    as_dtype = dtype if dtype in _DEQUANT_DTYPES else torch.float32  # float64 (tests): exact widening after
    if out is not None and out.device.type == "cuda" and as_dtype == dtype:
        torch.ops.bitsandbytes.dequantize_4bit.out(packed, absmax, blocksize, quant_type, [rows, cols], dtype, out=out)
        return out
    weight = torch.ops.bitsandbytes.dequantize_4bit.default(
        packed, absmax, blocksize, quant_type, [rows, cols], as_dtype
    )
    return weight.to(dtype)


def _dequantize_stack(packed, absmax, absmax2, code2, offset, rows, cols, spec, dtype, device) -> torch.Tensor:
    """The siblings' weights stacked along the output dimension: [sum(rows), cols]."""
    n = len(packed)
    nested: list[tuple[Any, Any, Any]] = [
        (absmax2[i], code2[i], offset[i]) if absmax2 else (None, None, None) for i in range(n)
    ]
    if n == 1:
        return _dequantize(packed[0], absmax[0], *nested[0], rows[0], cols, spec, dtype)
    stacked = torch.empty(sum(rows), cols, dtype=dtype, device=device)
    start = 0
    for i in range(n):  # each sibling's rows are one contiguous block of the stacked weight
        block = stacked[start : start + rows[i]]
        written = _dequantize(packed[i], absmax[i], *nested[i], rows[i], cols, spec, dtype, out=block)
        if written is not block:
            block.copy_(written)
        start += rows[i]
    return stacked


_FORWARD_SCHEMA = (
    "(Tensor x, Tensor h, Tensor sb, Tensor? bias, Tensor[] packed, Tensor[] absmax, Tensor[] absmax2, "
    "Tensor[] code2, Tensor[] offset, int[] rows, int blocksize, int blocksize2, str quant_type, bool concat) "
    "-> Tensor"
)
_GRAD_SCHEMA = (
    "(Tensor g, Tensor sb, Tensor[] packed, Tensor[] absmax, Tensor[] absmax2, Tensor[] code2, Tensor[] offset, "
    "int[] rows, int cols, int blocksize, int blocksize2, str quant_type, bool concat) -> Tensor"
)


@torch.library.custom_op("llmft::lora4bit_forward", mutates_args=(), schema=_FORWARD_SCHEMA)
def _forward_op(
    x, h, sb, bias, packed, absmax, absmax2, code2, offset, rows, blocksize, blocksize2, quant_type, concat
):
    """``x W^T + bias + h sb^T`` (x: [T, K], h: [T, R], sb: [N, R] = the scaled adapters' B), W dequantized here."""
    spec = (blocksize, blocksize2, quant_type)
    weight = _dequantize_stack(packed, absmax, absmax2, code2, offset, rows, x.shape[1], spec, x.dtype, x.device)
    if concat:  # [x | h] @ [W | sB]^T: the adapter folded into the matmul's K
        xh, weight = torch.cat([x, h], dim=1), torch.cat([weight, sb], dim=1)
        return torch.addmm(bias, xh, weight.t()) if bias is not None else xh @ weight.t()
    out = torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()
    return out.addmm_(h, sb.t())  # the rank-r product added in cuBLAS's epilogue


@_forward_op.register_fake
def _(x, h, sb, bias, packed, absmax, absmax2, code2, offset, rows, blocksize, blocksize2, quant_type, concat):
    return x.new_empty(x.shape[0], sum(rows))


@torch.library.custom_op("llmft::lora4bit_input_grad", mutates_args=(), schema=_GRAD_SCHEMA)
def _input_grad_op(
    g, sb, packed, absmax, absmax2, code2, offset, rows, cols, blocksize, blocksize2, quant_type, concat
):
    """``g @ W`` ([T, K]); with ``concat`` ``g @ [W | sb]`` = ``[dx through W | dh]`` ([T, K + R]) in one matmul."""
    spec = (blocksize, blocksize2, quant_type)
    weight = _dequantize_stack(packed, absmax, absmax2, code2, offset, rows, cols, spec, g.dtype, g.device)
    return g @ torch.cat([weight, sb], dim=1) if concat else g @ weight


@_input_grad_op.register_fake
def _(g, sb, packed, absmax, absmax2, code2, offset, rows, cols, blocksize, blocksize2, quant_type, concat):
    return g.new_empty(g.shape[0], cols + (sb.shape[1] if concat else 0))


# ----------------------------------------------------------------------------- the autograd node


def _state_tensors(bases) -> list[torch.Tensor]:
    """packed weights, block constants and (with double quantization) the constants' own constants and
    offsets of ``bases``, flat: n, n, then 3n or nothing."""
    states = [quant_state(b) for b in bases]
    flat = [b.weight for b in bases] + [s.absmax for s in states]
    if states[0].nested:
        flat += [s.state2.absmax for s in states] + [s.state2.code for s in states] + [s.offset for s in states]
    return flat


def _split_quant(flat, n: int) -> tuple[list, ...]:
    """(packed, absmax, absmax2, code2, offset) lists back from :func:`_state_tensors`' flat list."""
    lists = [list(flat[i * n : (i + 1) * n]) for i in range(len(flat) // n)]
    return (*lists, [], [], []) if len(lists) == 2 else tuple(lists)


class _Lora4bitFunction(torch.autograd.Function):
    """One or more 4-bit linears reading the same input (grouped siblings) as one node; see the module doc.
    ``static`` = (output rows of each sibling, each rank, (blocksize, nested blocksize, quant type), concat)."""

    @staticmethod
    def forward(ctx, x, static, scalings, dropouts, *tensors):
        n = len(scalings)
        rows, ranks, spec, concat = static
        biases, lora_as, lora_bs = (tensors[i * n : (i + 1) * n] for i in range(3))
        quant = tensors[3 * n :]
        in_shape = x.shape
        x2 = x.reshape(-1, in_shape[-1])
        a = torch.cat([la.to(x.dtype) for la in lora_as])
        if any(dropouts):  # PEFT: one mask per sibling, drawn in call order
            dropped = [drop_input(x2, p) for p in dropouts]
            masks = [mask for _, mask in dropped]
            spans = block_spans(ranks)
            h = torch.cat([xd @ a[k0:k1].t() for (xd, _), (k0, k1) in zip(dropped, spans, strict=True)], dim=1)
        else:
            masks, h = [None] * n, x2 @ a.t()
        sb = torch.block_diag(*[b.to(x.dtype) * s for b, s in zip(lora_bs, scalings, strict=True)])
        bias = torch.cat([b.to(x.dtype) for b in biases]) if biases[0] is not None else None
        out = torch.ops.llmft.lora4bit_forward(x2, h, sb, bias, *_split_quant(quant, n), rows, *spec, concat)
        ctx.save_for_backward(x2, h, a, sb, *masks, *quant)
        ctx.static, ctx.scalings, ctx.dropouts, ctx.in_shape = static, scalings, dropouts, in_shape
        ctx.dtypes = [t.dtype if t is not None else None for t in tensors[: 3 * n]]
        return out.view(*in_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, h, a, sb, *rest = ctx.saved_tensors
        n, (rows, ranks, spec, concat) = len(ctx.scalings), ctx.static
        masks, quant = rest[:n], _split_quant(rest[n:], n)
        d_in = x2.shape[1]
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(x2.dtype)
        both = torch.ops.llmft.lora4bit_input_grad(g, sb, *quant, rows, d_in, *spec, concat)
        dx_base, dh = (both[:, :d_in], both[:, d_in:]) if concat else (both, g @ sb)  # dh = s (dy B)
        spans, outs, needs = block_spans(ranks), block_spans(rows), ctx.needs_input_grad[4:]
        grad_x = None
        if ctx.needs_input_grad[0]:
            if not any(ctx.dropouts):
                grad_x = torch.addmm(dx_base, dh, a)
            else:
                grad_x = dx_base.clone()
                for (k0, k1), mask, p in zip(spans, masks, ctx.dropouts, strict=True):
                    grad_x += redrop(dh[:, k0:k1] @ a[k0:k1], mask, p)
            grad_x = grad_x.view(ctx.in_shape)
        grads = [None] * len(needs)
        grad_b = g.t() @ h if any(needs[2 * n : 3 * n]) else None  # [N, R]; sibling i's block is its dB / s_i
        for i in range(n):
            (r0, r1), (k0, k1) = outs[i], spans[i]
            if needs[i]:
                grads[i] = g[:, r0:r1].sum(0).to(ctx.dtypes[i])
            if needs[n + i]:
                dropped = redrop(x2, masks[i], ctx.dropouts[i])
                grads[n + i] = (dh[:, k0:k1].t() @ dropped).to(ctx.dtypes[n + i])
            if needs[2 * n + i]:
                grads[2 * n + i] = (grad_b[r0:r1, k0:k1] * ctx.scalings[i]).to(ctx.dtypes[2 * n + i])
        return (grad_x, None, None, None, *grads)


def lora_4bit_linear(x, bases, lora_as, lora_bs, scalings, dropouts=None, mode: str = "auto") -> torch.Tensor:
    """``[x W_i^T + b_i + s_i (drop_i(x) A_i^T) B_i^T for each 4-bit base i]`` side by side in one (..., sum
    d_out) tensor; one base is the per-module fused path, several are a grouped q/k/v or gate/up. ``mode``:
    "concat", "epilogue", or "auto" (concat where the group's d_out > d_in: lora.py's rule)."""
    biases = [b.bias for b in bases]
    if len({b is None for b in biases}) != 1:
        raise ValueError("grouped LoRA projections need all biases or none")
    if len({layout(b) for b in bases}) != 1:
        raise ValueError("grouped 4-bit projections need one quantization layout")
    first = layout(bases[0])
    rows = [out_features(b) for b in bases]
    concat = sum(rows) > first.in_features if mode == "auto" else mode == "concat"
    static = (
        tuple(rows),
        tuple(int(la.shape[0]) for la in lora_as),
        (first.blocksize, first.nested_blocksize, first.quant_type),
        concat,
    )
    drops = tuple(float(p) for p in (dropouts or [0.0] * len(bases)))
    return _Lora4bitFunction.apply(
        x,
        static,
        tuple(float(s) for s in scalings),
        drops,
        *biases,
        *lora_as,
        *lora_bs,
        *_state_tensors(bases),
    )
