"""Sibling LoRA projections that read the same input, run as one matmul.

Attention's q/k/v projections and the MLP's gate/up projections read the same
hidden states. With one fused LoRA linear per projection (lora.py) a Qwen2 or
Llama layer launches about 52 matmuls per training step, and a profile of the
trainer (benchmarks/NOTES.md, entry 18) showed the step bound by the host
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
"""

from __future__ import annotations

import types

import torch
from llmft.trainer.fastpath.lora import adapter_in_use

# (parent attribute names) that transformers' decoder layers call with one shared input.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _stacked_weight(weights, lora_bs, scalings, dtype) -> torch.Tensor:
    """``[W_i | s_i B_i on the block diagonal]``: (sum of d_out, d_in + sum of r)."""
    base = torch.cat([w.to(dtype) for w in weights])
    adapters = torch.block_diag(*[b.to(dtype) * s for b, s in zip(lora_bs, scalings, strict=True)])
    return torch.cat([base, adapters], dim=1)


class _GroupedLoraFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scalings, *tensors):
        n = len(scalings)
        weights, biases, lora_as, lora_bs = (tensors[i * n : (i + 1) * n] for i in range(4))
        in_shape = x.shape
        x2 = x.reshape(-1, in_shape[-1])
        a = torch.cat([la.to(x.dtype) for la in lora_as])
        xh = torch.cat([x2, x2 @ a.t()], dim=1)
        wb = _stacked_weight(weights, lora_bs, scalings, x.dtype)
        if biases[0] is not None:
            out = torch.addmm(torch.cat([b.to(x.dtype) for b in biases]), xh, wb.t())
        else:
            out = xh @ wb.t()
        ctx.save_for_backward(xh, a, *weights, *lora_bs)
        ctx.scalings, ctx.in_shape = scalings, in_shape
        ctx.dtypes = [t.dtype if t is not None else None for t in tensors]
        return out.view(*in_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xh, a, *rest = ctx.saved_tensors
        scalings, n = ctx.scalings, len(ctx.scalings)
        weights, lora_bs = rest[:n], rest[n:]
        d_in = ctx.in_shape[-1]
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(xh.dtype)
        both = g @ _stacked_weight(weights, lora_bs, scalings, xh.dtype)  # [dx through W | dh]
        dh = both[:, d_in:]
        needs = ctx.needs_input_grad[2:]
        grad_x = torch.addmm(both[:, :d_in], dh, a).view(ctx.in_shape) if ctx.needs_input_grad[0] else None
        grads = [None] * (4 * n)
        rows = _offsets([w.shape[0] for w in weights])
        ranks = _offsets([b.shape[1] for b in lora_bs])
        grad_a = dh.t() @ xh[:, :d_in] if any(needs[2 * n : 3 * n]) else None
        grad_b = g.t() @ xh[:, d_in:] if any(needs[3 * n :]) else None
        for i in range(n):
            (r0, r1), (k0, k1) = rows[i], ranks[i]
            if needs[i]:  # a trained base weight (not LoRA's case, kept exact anyway)
                grads[i] = (g[:, r0:r1].t() @ xh[:, :d_in]).to(ctx.dtypes[i])
            if needs[n + i]:
                grads[n + i] = g[:, r0:r1].sum(0).to(ctx.dtypes[n + i])
            if needs[2 * n + i]:
                grads[2 * n + i] = grad_a[k0:k1].to(ctx.dtypes[2 * n + i])
            if needs[3 * n + i]:
                grads[3 * n + i] = (grad_b[r0:r1, k0:k1] * scalings[i]).to(ctx.dtypes[3 * n + i])
        return (grad_x, None, *grads)


def _offsets(sizes) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def grouped_lora_linear(x, weights, biases, lora_as, lora_bs, scalings) -> torch.Tensor:
    """``[x W_i^T + b_i + s_i (x A_i^T) B_i^T for each i]`` side by side in one (..., sum d_out) tensor.
    ``biases``: all tensors or all None."""
    if len({b is None for b in biases}) != 1:
        raise ValueError("grouped LoRA projections need all biases or none")
    return _GroupedLoraFunction.apply(x, tuple(float(s) for s in scalings), *weights, *biases, *lora_as, *lora_bs)


def _grouped_forward(self, *args, **kwargs):
    """Parent forward: the group's projections in one node, then the original forward."""
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
    members = [getattr(self, name) for name in self._llmft_group]
    names = [adapter_in_use(m) for m in members]
    if x is None or None in names:
        return self._llmft_forward(*args, **kwargs)
    bases = [m.get_base_layer() for m in members]
    out = grouped_lora_linear(
        x,
        [b.weight for b in bases],
        [b.bias for b in bases],
        [m.lora_A[n].weight for m, n in zip(members, names, strict=True)],
        [m.lora_B[n].weight for m, n in zip(members, names, strict=True)],
        [m.scaling[n] for m, n in zip(members, names, strict=True)],
    )
    start = 0
    for member, base in zip(members, bases, strict=True):
        member._llmft_given = (x, out[..., start : start + base.weight.shape[0]])
        start += base.weight.shape[0]
    try:
        return self._llmft_forward(*args, **kwargs)
    finally:
        for member in members:
            member._llmft_given = None


def _why_not_groupable(members) -> str | None:
    bases = [m.get_base_layer() for m in members]
    if not all(hasattr(m, "_llmft_peft_forward") for m in members):
        return "not every projection runs the fused LoRA forward"
    if len({b.weight.shape[1] for b in bases}) != 1 or len({(b.weight.dtype, b.weight.device) for b in bases}) != 1:
        return "projections differ in input width, dtype or device"
    if len({b.bias is None for b in bases}) != 1:
        return "some projections have a bias and some do not"
    if len({tuple(m.lora_A) for m in members}) != 1:
        return "projections carry different adapters"
    return None


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
