"""A fused LoRA linear for PEFT models: ``y = x W^T + b + s (drop(x) A^T) B^T`` in one
autograd node with fewer passes over the activations.

PEFT's ``lora.Linear`` runs the base layer, then ``lora_B(lora_A(dropout(x)))``,
then multiplies by the scaling and adds: the (tokens x d_out) LoRA output is
written, read back, scaled and summed into a third tensor, and the adapters,
kept in fp32 by PEFT, pull the activations up to fp32 for their matmuls. Here:

- forward: ``h = drop(x) A^T`` (tokens x r, tiny) and the base matmul, then
  ``out.addmm_(h, B^T, alpha=s)``: cuBLAS adds the rank-r product into the base
  output in its epilogue (one read + write of ``out`` instead of four passes);
- backward: ``g = s (dy B)`` (tokens x r), ``dx = dy W`` then ``dx += drop'(g A)``,
  ``dA = g^T drop(x)``, ``dB = s dy^T h``: no (tokens x d_out) temporaries at all;
- matmuls in the activations' dtype (bf16) with fp32 accumulation; gradients are
  returned in the adapters' own dtype (fp32 master weights stay fp32).

LoRA dropout keeps PEFT's semantics: in training mode the adapter path sees
``drop(x) = x * mask / (1 - p)`` with a Bernoulli(1 - p) mask, one mask per adapted linear,
drawn when that linear runs; the base path sees ``x`` itself. The mask is a function of two
seed words drawn from torch's generator and the element's (row, column) (lora_dropout.py:
Philox, made in registers by Triton kernels on CUDA inside the adapter's thin matmuls): no
mask is stored and the input is read no extra time. In eval mode (or ``p = 0``) nothing is drawn.
The 4-bit path (qlora.py) still draws its mask with ``torch.native_dropout`` (lora_dropout.drop_input).

:func:`fuse_lora_linears` swaps this forward into every PEFT ``lora.Linear``
that it covers exactly (one active adapter, no DoRA or other variant, unmerged,
a plain ``nn.Linear`` base, dropout an ``nn.Dropout`` or none), leaving the module,
its parameters and its state-dict keys untouched, so saving and loading adapters is
unchanged. PEFT's ``lora.Linear4bit`` over a bitsandbytes 4-bit base (QLoRA) takes the same
forward with the base weight dequantized inside (qlora.py). Others keep PEFT's forward. Not for
DeepSpeed ZeRO-3 (its partitioned base weights are gathered by hooks on the base layer
this skips).
"""

from __future__ import annotations

import types

import torch

from llmft.trainer.fastpath.lora_dropout import draw_seeds, dropped_down, dropped_grad_a, dropped_up_add
from llmft.trainer.fastpath.qlora import lora_4bit_linear, why_not_4bit


def _grad_a(g_h, x2, seeds, p: float, rank: int, dtype) -> torch.Tensor:
    """dA = g_h^T drop(x), the mask regenerated from ``seeds`` (None: no dropout)."""
    if seeds is None:
        return (g_h.t() @ x2).to(dtype)
    return dropped_grad_a(g_h, x2, seeds, p, rank).to(dtype)


class _LoraLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, p):
        in_shape = x.shape
        x2 = x.reshape(-1, in_shape[-1])
        a = lora_a.to(x.dtype)
        b = lora_b.to(x.dtype)
        seeds = draw_seeds(1, x.device) if p > 0 else None
        h = x2 @ a.t() if seeds is None else dropped_down(x2, a, seeds, p, a.shape[0])
        out = torch.addmm(bias.to(x.dtype), x2, weight.t()) if bias is not None else x2 @ weight.t()
        out.addmm_(h, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, weight, a, b, h, seeds)
        ctx.scaling, ctx.p = scaling, p
        ctx.in_shape = in_shape
        ctx.dtypes = (lora_a.dtype, lora_b.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.view(*in_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight, a, b, h, seeds = ctx.saved_tensors
        a_dtype, b_dtype, w_dtype, bias_dtype = ctx.dtypes
        g_out = grad_out.reshape(-1, grad_out.shape[-1]).to(x2.dtype)
        g_h = (g_out @ b) * ctx.scaling
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = g_out @ weight.to(x2.dtype)
            if seeds is None:
                grad_x.addmm_(g_h, a)
            else:
                grad_x = dropped_up_add(grad_x, g_h, a, seeds, ctx.p, a.shape[0])
            grad_x = grad_x.view(ctx.in_shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g_out.t() @ x2).to(w_dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = g_out.sum(0).to(bias_dtype)
        grad_a = _grad_a(g_h, x2, seeds, ctx.p, a.shape[0], a_dtype) if ctx.needs_input_grad[3] else None
        grad_b = ((g_out.t() @ h) * ctx.scaling).to(b_dtype) if ctx.needs_input_grad[4] else None
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None


class _LoraLinearConcatFunction(torch.autograd.Function):
    """The same function with the adapter folded into the base matmul's K dimension:
    ``[x | h] @ [W | s B]^T``; backward gets ``[dx_base | s dy B]`` from one matmul
    ``dy @ [W | s B]``. Cheaper than the epilogue form when d_out > d_in (gate/up),
    where every extra pass over the (tokens x d_out) output costs most."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, p):
        in_shape = x.shape
        x2 = x.reshape(-1, in_shape[-1])
        a = lora_a.to(x.dtype)
        seeds = draw_seeds(1, x.device) if p > 0 else None
        h = x2 @ a.t() if seeds is None else dropped_down(x2, a, seeds, p, a.shape[0])
        xh = torch.cat([x2, h], dim=1)
        wb = torch.cat([weight.to(x.dtype), lora_b.to(x.dtype) * scaling], dim=1)
        out = torch.addmm(bias.to(x.dtype), xh, wb.t()) if bias is not None else xh @ wb.t()
        ctx.save_for_backward(xh, weight, a, lora_b, seeds)
        ctx.scaling, ctx.p = scaling, p
        ctx.in_shape = in_shape
        ctx.dtypes = (lora_a.dtype, lora_b.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.view(*in_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xh, weight, a, lora_b, seeds = ctx.saved_tensors
        a_dtype, b_dtype, w_dtype, bias_dtype = ctx.dtypes
        d_in = weight.shape[1]
        g_out = grad_out.reshape(-1, grad_out.shape[-1]).to(xh.dtype)
        wb = torch.cat([weight.to(xh.dtype), lora_b.to(xh.dtype) * ctx.scaling], dim=1)
        both = g_out @ wb  # [dx through W | s dy B]
        g_h = both[:, d_in:]
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            if seeds is None:
                grad_x = torch.addmm(both[:, :d_in], g_h, a)
            else:
                grad_x = dropped_up_add(both[:, :d_in], g_h, a, seeds, ctx.p, a.shape[0])
            grad_x = grad_x.view(ctx.in_shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g_out.t() @ xh[:, :d_in]).to(w_dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = g_out.sum(0).to(bias_dtype)
        grad_a = _grad_a(g_h, xh[:, :d_in], seeds, ctx.p, a.shape[0], a_dtype) if ctx.needs_input_grad[3] else None
        grad_b = ((g_out.t() @ xh[:, d_in:]) * ctx.scaling).to(b_dtype) if ctx.needs_input_grad[4] else None
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, None


LORA_MODES = ("auto", "epilogue", "concat")
"""Which form a fused linear uses: "epilogue" (addmm into the base output), "concat" (adapter folded
into K), or "auto" (concat when d_out > d_in). Chosen per call (:func:`lora_linear`'s ``mode``) or per
model (:func:`fuse_lora_linears`' ``mode``, which each fused module keeps)."""


def lora_linear(
    x, weight, bias, lora_a, lora_b, scaling: float, mode: str = "auto", dropout: float = 0.0
) -> torch.Tensor:
    """``x W^T + b + scaling * (drop(x) A^T) B^T`` as one autograd node (see module doc);
    ``mode`` one of :data:`LORA_MODES`; ``dropout`` is the LoRA dropout probability of a module in
    training mode (0 in eval mode)."""
    if mode not in LORA_MODES:
        raise ValueError(f"LoRA mode {mode!r}: one of {LORA_MODES}")
    if mode == "auto":
        mode = "concat" if weight.shape[0] > weight.shape[1] else "epilogue"
    fn = _LoraLinearConcatFunction if mode == "concat" else _LoraLinearFunction
    return fn.apply(x, weight, bias, lora_a, lora_b, float(scaling), float(dropout))


def dropout_p(module, adapter: str) -> float:
    """The LoRA dropout probability ``module`` applies to ``adapter`` now (0 in eval mode or without dropout)."""
    drop = module.lora_dropout[adapter]
    return float(drop.p) if isinstance(drop, torch.nn.Dropout) and drop.training else 0.0


def adapter_in_use(module) -> str | None:
    """The one active adapter a fused lora.Linear applies right now; None where it falls back to
    PEFT (disabled, merged, several adapters) or is no LoRA layer any more (merge_and_unload)."""
    if not hasattr(module, "lora_A"):
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if module.disable_adapters or module.merged or len(active) != 1:
        return None
    return active[0]


def take_given_output(module, x):
    """The output a grouped parent (lora_groups.py) computed for ``module`` from this very ``x``, else None."""
    given = getattr(module, "_llmft_given", None)
    if given is None or given[0] is not x:
        return None
    module._llmft_given = None
    return given[1]


def _fused_forward(self, x, *args, **kwargs):
    given = take_given_output(self, x)  # computed with its siblings by a grouped parent
    if given is not None:
        return given
    name = adapter_in_use(self)
    if args or kwargs or name is None:
        return self._llmft_peft_forward(x, *args, **kwargs)
    base = self.get_base_layer()
    if type(base) is not torch.nn.Linear:  # a 4-bit base (_why_not_fusable admitted nothing else)
        lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
        drop = [dropout_p(self, name)]
        return lora_4bit_linear(x, [base], [lora_a], [lora_b], [self.scaling[name]], drop, self._llmft_lora_mode)
    return lora_linear(
        x,
        base.weight,
        base.bias,
        self.lora_A[name].weight,
        self.lora_B[name].weight,
        self.scaling[name],
        mode=self._llmft_lora_mode,
        dropout=dropout_p(self, name),
    )


def _why_not_fusable(module) -> str | None:
    """None when the module's LoRA can take the fused forward, else the reason."""
    base = module.get_base_layer()
    if type(base) is not torch.nn.Linear:
        reason = why_not_4bit(base)
        if reason is not None:
            return reason
    if hasattr(base.weight, "ds_id"):
        return "DeepSpeed ZeRO-3 partitioned weight"
    if getattr(module, "lora_variant", None):
        return "a LoRA variant (DoRA, ...) is active"
    if any(getattr(module, "use_dora", {}).values()):
        return "DoRA"
    if any(getattr(module, "lora_bias", {}).values()):
        return "a bias on lora_B (lora_bias) is not reproduced"
    for dropout in module.lora_dropout.values():
        if type(dropout) not in (torch.nn.Identity, torch.nn.Dropout):
            return f"LoRA dropout module {type(dropout).__name__} (only nn.Dropout is reproduced)"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    return None


def is_lora_linear(module) -> bool:
    """PEFT's ``lora.Linear``, or its ``lora.Linear4bit`` (a bitsandbytes 4-bit base; peft/tuners/lora/bnb.py
    defines it only where bitsandbytes imports, and it is no subclass of ``lora.Linear``)."""
    # heavy: peft
    from peft.tuners.lora.layer import Linear as LoraLinear

    cls = type(module)
    return isinstance(module, LoraLinear) or (cls.__name__ == "Linear4bit" and cls.__module__ == "peft.tuners.lora.bnb")


def fuse_lora_linears(model: torch.nn.Module, mode: str = "auto") -> dict[str, str]:
    """Swap the fused forward into every PEFT lora.Linear (or lora.Linear4bit) it covers exactly;
    each runs the form ``mode`` names (:data:`LORA_MODES`).

    Returns ``{module name: reason}`` for the LoRA linears left on PEFT's forward
    (empty when every one was fused). Idempotent.
    """
    if mode not in LORA_MODES:
        raise ValueError(f"LoRA mode {mode!r}: one of {LORA_MODES}")
    skipped: dict[str, str] = {}
    for name, module in model.named_modules():
        if not is_lora_linear(module) or hasattr(module, "_llmft_peft_forward"):
            continue
        reason = _why_not_fusable(module)
        if reason is not None:
            skipped[name] = reason
            continue
        module._llmft_peft_forward = module.forward
        module._llmft_lora_mode = mode
        module.forward = types.MethodType(_fused_forward, module)
    return skipped


def count_fused(model: torch.nn.Module) -> int:
    """How many LoRA linears run the fused forward."""
    return sum(1 for m in model.modules() if hasattr(m, "_llmft_peft_forward"))
