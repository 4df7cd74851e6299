"""Sibling LoRA projections that read the same input, run as one matmul.

Attention's q/k/v projections and the MLP's gate/up projections read the same
hidden states. With one fused LoRA linear per projection (lora.py) a Qwen2 or
Llama layer launches about 52 matmuls per training step, and a profile of the
trainer (benchmarks/NOTES.md) showed the step bound by the host
launching them: the GPU sat idle a quarter of the step. Grouped, the siblings
are one autograd node over the stacked weights: ``A = [A_q; A_k; A_v]`` gives
one ``h = x A^T`` for all of them, and ``B`` (scaled, block diagonal) is folded
into the base matmul's K dimension, ``[x | h] @ [W_q | s B_q 0 0; W_k | 0 s B_k 0;
W_v | 0 0 s B_v]^T`` (lora.py's concat form). Backward: one ``dy @ [W | B]``
gives ``[dx through W | dh]``, then ``dA = dh^T x`` and ``dB = dy^T h``, one
matmul each for the whole group. About 28 matmuls per layer instead of 52, and
the shared input is read once instead of once per projection.

It plugs in without copying transformers' attention or MLP code: the parent
module's forward is wrapped. The wrapper computes the group's output, hands
each child its column slice together with the input it was computed from, then
calls the original forward; a child called with that same input tensor
returns its slice, with any other input it computes as before. Same sums as
the per-projection path, so the result is exact up to rounding order.

LoRA dropout (PEFT's semantics, lora.py): each sibling draws its own mask over
the shared input (its own seed words, lora_dropout.py), in the order the layer calls
them (q, k, v; gate, up), and its adapter reads its own dropped input; the base matmul
reads the input itself. On CUDA one kernel makes every sibling's mask from one read of
the input; nothing is stored for the backward but the seeds. Siblings group only with
one dropout probability and one rank.

4-bit siblings (QLoRA) group when they share one quantization layout (input width, block size,
quant type, double quantization, storage dtype): qlora.py dequantizes them into one stacked
weight and runs the same concat form; otherwise each runs its own fused 4-bit node.
"""

from __future__ import annotations

import types

import torch

from llmft.trainer.fastpath.lora import adapter_in_use, dropout_p
from llmft.trainer.fastpath.lora_dropout import draw_seeds, dropped_down, dropped_grad_a, dropped_up_add, spans
from llmft.trainer.fastpath.qlora import is_4bit, layout, lora_4bit_linear, out_features

# (parent attribute names) that transformers' decoder layers call with one shared input.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _stacked_weight(weights, lora_bs, scalings, dtype) -> torch.Tensor:
    """``[W_i | s_i B_i on the block diagonal]``: (sum of d_out, d_in + sum of r)."""
    base = torch.cat([w.to(dtype) for w in weights])
    adapters = torch.block_diag(*[b.to(dtype) * s for b, s in zip(lora_bs, scalings, strict=True)])
    return torch.cat([base, adapters], dim=1)


class _GroupedLoraFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scalings, dropouts, *tensors):
        n = len(scalings)
        weights, biases, lora_as, lora_bs = (tensors[i * n : (i + 1) * n] for i in range(4))
        in_shape = x.shape
        x2 = x.reshape(-1, in_shape[-1])
        a = torch.cat([la.to(x.dtype) for la in lora_as])
        seeds = _seeds(dropouts, lora_as, x.device)
        if seeds is not None:  # PEFT: one mask per sibling (its own seed words), drawn in call order
            h = dropped_down(x2, a, seeds, dropouts[0], lora_as[0].shape[0])
        else:
            h = x2 @ a.t()
        xh = torch.cat([x2, h], dim=1)
        wb = _stacked_weight(weights, lora_bs, scalings, x.dtype)
        if biases[0] is not None:
            out = torch.addmm(torch.cat([b.to(x.dtype) for b in biases]), xh, wb.t())
        else:
            out = xh @ wb.t()
        ctx.save_for_backward(xh, a, *weights, *lora_bs, seeds)
        ctx.scalings, ctx.dropouts, ctx.in_shape = scalings, dropouts, in_shape
        ctx.dtypes = [t.dtype if t is not None else None for t in tensors]
        return out.view(*in_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xh, a, *rest = ctx.saved_tensors
        scalings, dropouts, n = ctx.scalings, ctx.dropouts, len(ctx.scalings)
        weights, lora_bs, seeds = rest[:n], rest[n : 2 * n], rest[2 * n]
        d_in = ctx.in_shape[-1]
        x2 = xh[:, :d_in]
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(xh.dtype)
        both = g @ _stacked_weight(weights, lora_bs, scalings, xh.dtype)  # [dx through W | dh]
        dh = both[:, d_in:]
        needs = ctx.needs_input_grad[3:]
        rows = spans([w.shape[0] for w in weights])
        ranks = spans([b.shape[1] for b in lora_bs])
        rank = ranks[0][1]
        grad_x = None
        if ctx.needs_input_grad[0]:
            if seeds is None:
                grad_x = torch.addmm(both[:, :d_in], dh, a)
            else:
                grad_x = dropped_up_add(both[:, :d_in], dh, a, seeds, dropouts[0], rank)
            grad_x = grad_x.view(ctx.in_shape)
        grads = [None] * (4 * n)
        if not any(needs[2 * n : 3 * n]):
            grad_a = None
        elif seeds is None:
            grad_a = dh.t() @ x2
        else:
            grad_a = dropped_grad_a(dh, x2, seeds, dropouts[0], rank)
        grad_b = g.t() @ xh[:, d_in:] if any(needs[3 * n :]) else None
        for i in range(n):
            (r0, r1), (k0, k1) = rows[i], ranks[i]
            if needs[i]:  # a trained base weight (not LoRA's case, kept exact anyway)
                grads[i] = (g[:, r0:r1].t() @ x2).to(ctx.dtypes[i])
            if needs[n + i]:
                grads[n + i] = g[:, r0:r1].sum(0).to(ctx.dtypes[n + i])
            if needs[2 * n + i]:
                grads[2 * n + i] = grad_a[k0:k1].to(ctx.dtypes[2 * n + i])
            if needs[3 * n + i]:
                grads[3 * n + i] = (grad_b[r0:r1, k0:k1] * scalings[i]).to(ctx.dtypes[3 * n + i])
        return (grad_x, None, None, *grads)


def _seeds(dropouts, lora_as, device) -> torch.Tensor | None:
    """One seed pair per sibling when dropout is on (None when off)."""
    if not any(dropouts):
        return None
    if len(set(dropouts)) != 1 or len({la.shape[0] for la in lora_as}) != 1:
        raise ValueError("grouped LoRA projections with dropout need one dropout and one rank for all siblings")
    return draw_seeds(len(dropouts), device)


def grouped_lora_linear(x, weights, biases, lora_as, lora_bs, scalings, dropouts=None) -> torch.Tensor:
    """``[x W_i^T + b_i + s_i (drop_i(x) A_i^T) B_i^T for each i]`` side by side in one (..., sum d_out)
    tensor. ``biases``: all tensors or all None; ``dropouts``: each sibling's LoRA dropout (default none)."""
    if len({b is None for b in biases}) != 1:
        raise ValueError("grouped LoRA projections need all biases or none")
    drops = tuple(float(p) for p in (dropouts or [0.0] * len(weights)))
    return _GroupedLoraFunction.apply(
        x, tuple(float(s) for s in scalings), drops, *weights, *biases, *lora_as, *lora_bs
    )


def _grouped_forward(self, *args, **kwargs):
    """Parent forward: the group's projections in one node, then the original forward."""
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
    members = [getattr(self, name) for name in self._llmft_group]
    names = [adapter_in_use(m) for m in members]
    if x is None or None in names:
        return self._llmft_forward(*args, **kwargs)
    bases = [m.get_base_layer() for m in members]
    lora_as = [m.lora_A[n].weight for m, n in zip(members, names, strict=True)]
    lora_bs = [m.lora_B[n].weight for m, n in zip(members, names, strict=True)]
    scalings = [m.scaling[n] for m, n in zip(members, names, strict=True)]
    dropouts = [dropout_p(m, n) for m, n in zip(members, names, strict=True)]
    if is_4bit(bases[0]):  # QLoRA: one stacked dequantized weight (qlora.py)
        out = lora_4bit_linear(x, bases, lora_as, lora_bs, scalings, dropouts)
    else:
        weights, biases = [b.weight for b in bases], [b.bias for b in bases]
        out = grouped_lora_linear(x, weights, biases, lora_as, lora_bs, scalings, dropouts)
    start = 0
    for member, base in zip(members, bases, strict=True):
        member._llmft_given = (x, out[..., start : start + out_features(base)])
        start += out_features(base)
    try:
        return self._llmft_forward(*args, **kwargs)
    finally:
        for member in members:
            member._llmft_given = None


def _why_not_groupable(members) -> str | None:
    bases = [m.get_base_layer() for m in members]
    if not all(hasattr(m, "_llmft_peft_forward") for m in members):
        return "not every projection runs the fused LoRA forward"
    four_bit = {is_4bit(b) for b in bases}
    if len(four_bit) != 1:
        return "some projections are 4-bit and some are not"
    if four_bit == {True} and len({layout(b) for b in bases}) != 1:
        return "4-bit projections differ in input width or quantization layout (block size, type, storage)"
    if len({b.in_features for b in bases}) != 1 or len({(b.weight.dtype, b.weight.device) for b in bases}) != 1:
        return "projections differ in input width, dtype or device"
    if len({b.bias is None for b in bases}) != 1:
        return "some projections have a bias and some do not"
    if len({tuple(m.lora_A) for m in members}) != 1:
        return "projections carry different adapters"
    if four_bit == {False} and len({_dropout_and_ranks(m) for m in members}) != 1:
        return "projections differ in LoRA dropout or rank (one dropout kernel serves the group)"
    return None


def _dropout_and_ranks(module) -> tuple:
    drops = tuple(float(getattr(d, "p", 0.0)) for d in module.lora_dropout.values())
    return drops, tuple(a.weight.shape[0] for a in module.lora_A.values())


def group_lora_projections(model: torch.nn.Module) -> dict[str, str]:
    """Wrap every parent whose q/k/v (or gate/up) are fused LoRA linears (call after
    lora.fuse_lora_linears). Returns ``{parent name: reason}`` for parents left ungrouped. Idempotent."""
    skipped: dict[str, str] = {}
    for name, module in model.named_modules():
        if hasattr(module, "_llmft_group"):
            continue
        for group in GROUPS:
            members = [getattr(module, attr, None) for attr in group]
            if any(m is None for m in members):
                continue
            if not all(hasattr(m, "lora_A") for m in members):
                continue
            reason = _why_not_groupable(members)
            if reason is not None:
                skipped[name] = reason
                continue
            module._llmft_group = group
            module._llmft_forward = module.forward
            module.forward = types.MethodType(_grouped_forward, module)
            break  # one group per parent: its forward is wrapped once
    return skipped


def count_grouped(model: torch.nn.Module) -> int:
    """How many parent modules run their projections grouped."""
    return sum(1 for m in model.modules() if hasattr(m, "_llmft_group"))
