"""Mixture-of-experts models (Qwen3-MoE shape), fast: grouped experts, expert LoRA, 4-bit experts.
What training needs on any path (LoRA targets, frozen routers, the load-balancing loss) is
llmft/trainer/moe_model.py's and llmft/trainer/moe_aux.py's; :func:`apply_moe` applies both and reports.

transformers 5.x (5.17 on the GPU image, 5.24 here) stores a layer's experts as two fused 3-D
parameters, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (``Qwen3MoeExperts``,
decorated with ``use_experts_implementation``), and routes with ``Qwen3MoeTopKRouter`` (a bare
``weight`` parameter, not an ``nn.Linear``). Its default experts implementation is already
``grouped_mm`` (``PreTrainedModel.get_correct_experts_implementation``: ``"grouped_mm"`` when none
is requested; 5.17 and 5.24 alike), so the frozen base experts need no help. What does:

- **LoRA targets.** PEFT 0.21 rewrites ``target_modules="all-linear"`` on these models into
  ``target_parameters`` that include the router (``gate.weight``) and both expert tensors
  (``peft/utils/transformers_weight_conversion.py``, ``_resolve_string_target_modules``).
  llmft/trainer/moe_model.py's ``peft_targets`` resolves targets itself: ``all-linear`` = the attention projections;
  ``experts`` (or ``experts.gate_up_proj`` / ``experts.down_proj``) = LoRA on the expert tensors
  through PEFT's ``target_parameters``; the router is never adapted and stays frozen.
- **Expert LoRA.** PEFT's ``ParamWrapper`` applies an expert adapter by parametrizing the whole
  weight: every forward builds ``W + s B A`` for all E experts ([E, 2I, H] per layer) and the
  grouped matmul saves that tensor for backward (48 x 1.2 GB for the Qwen3-30B-A3B shape).
  :func:`grouped_experts` computes ``x W_e^T + s (x A_e^T) B_e^T`` per expert group instead
  (tokens sorted by expert, grouped matmuls), never forming the merged weight. Parameter names
  and state dicts stay PEFT's, so saving and loading adapters is unchanged.
- **4-bit experts (QLoRA).** bitsandbytes' 4-bit linear layers do not cover fused 3-D expert
  parameters (bitsandbytes issue 1849); :func:`quantize_experts_4bit` stores them with
  ``bitsandbytes.nn.parametrize.replace_parameter_4bit`` (NF4, bnb 0.50) and the grouped matmul
  dequantizes one layer's weight when it needs it, in forward and again in backward, saving none.

The grouped matmul is ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` where the dtype
and strides allow it, else a per-expert matmul loop over the sorted tokens (same result).
:func:`apply_moe` switches these on and returns what ran, for the ``FastPath`` decision's ``moe``.
"""

from __future__ import annotations

import math
import types
from typing import Any, Literal, cast

import torch

from llmft.trainer.fastpath.moe_rows import Routing, profiled, swiglu_scaled
from llmft.trainer.fastpath.qlora import _dequantize
from llmft.trainer.moe_aux import install_router_aux
from llmft.trainer.moe_model import base_experts, freeze_routers, model_config, moe_blocks

# ----------------------------------------------------------------------------- finding the pieces


def expert_wrappers(module) -> dict[str, Any]:
    """``{parameter name: PEFT ParamWrapper}`` wrapped around one experts module (outermost first)."""
    found = {}
    while hasattr(module, "parameter_name") and hasattr(module, "base_layer"):
        found[module.parameter_name] = module
        module = module.base_layer
    return found


# ----------------------------------------------------------------------------- grouped matmul


def grouped_kernel(dtype: torch.dtype, device: torch.device, widths: tuple[int, ...]) -> str:
    """Which grouped matmul runs for operands of ``dtype`` whose row widths are ``widths``:
    ``torch.grouped_mm`` (one kernel for every expert) or ``loop`` (one matmul per expert)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return "loop"
    allowed = (torch.bfloat16,) if device.type == "cuda" else (torch.bfloat16, torch.float16, torch.float32)
    size = torch.empty((), dtype=dtype).element_size()
    if dtype not in allowed or any((w * size) % 16 for w in widths):
        return "loop"  # the kernels need 16-byte aligned rows (torch: "strides should be multiple of 16 bytes")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "loop"
    return "torch.grouped_mm"


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, kernel: str) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` [S, K] times ``w[e]`` [K, N] -> [S, N]."""
    if kernel == "torch.grouped_mm":
        fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        return fn(x, w, offs=offs)
    pieces, start = [], 0
    for e, end in enumerate(offs.tolist()):  # one host sync per call (the fallback only)
        if end > start:
            pieces.append(x[start:end] @ w[e])
        start = end
    return torch.cat(pieces) if pieces else x.new_zeros(0, w.shape[-1])


class _DequantGroupedLinear(torch.autograd.Function):
    """``x @ W_e^T`` for a frozen weight that is rebuilt (dequantized) on every use: forward and
    backward each fetch it, so the [E, out, in] bf16 copy is never saved between them."""

    @staticmethod
    def forward(ctx, x, offs, fetch, kernel):
        ctx.save_for_backward(offs)
        ctx.fetch, ctx.kernel = fetch, kernel
        with profiled("moe.dequant"):
            w = fetch(x.dtype)
        with profiled("moe.grouped_mm"):
            return _gmm(x, w.transpose(-2, -1), offs, kernel)

    @staticmethod
    def backward(ctx, grad):
        (offs,) = ctx.saved_tensors
        with profiled("moe.bwd.dequant"):
            w = ctx.fetch(grad.dtype)
        with profiled("moe.bwd.grouped_mm"):
            return _gmm(grad.contiguous(), w, offs, ctx.kernel), None, None, None


def _frozen_linear(x, experts, name: str, offs, kernel: str) -> torch.Tensor:
    if getattr(experts, "_llmft_4bit", False):
        return _DequantGroupedLinear.apply(x, offs, _dequantizer(experts, name), kernel)
    weight = getattr(experts, name)
    with profiled("moe.grouped_mm"):
        return _gmm(x, weight.to(x.dtype).transpose(-2, -1), offs, kernel)


def _dequantizer(experts, name: str):
    """``fetch(dtype)``: the 4-bit tensor ``name`` of ``experts`` dequantized, [E, out, in], by the same
    bitsandbytes kernels its parametrization calls (``functional.dequantize_4bit``), called directly:
    reading the parametrized attribute costs about as much host time again (parametrize's property,
    the QuantState unpacking) four times per layer and micro step."""
    state = _quant_state(experts, name)
    packed = experts.parametrizations[name].original
    nested = (state.state2.absmax, state.state2.code, state.offset) if state.nested else (None, None, None)
    spec = (state.blocksize, state.state2.blocksize if state.nested else 0, state.quant_type)
    shape = tuple(state.shape)
    rows, cols = math.prod(shape[:-1]), shape[-1]

    def fetch(dtype):
        flat = _dequantize(packed, state.absmax, *nested, rows, cols, spec, dtype)
        return flat.view(shape)

    return fetch


def _lora_delta(x, lora: tuple, offs, kernel: str, num_experts: int) -> torch.Tensor:
    """``s (x A_e^T) B_e^T`` per expert group, from PEFT's ParamWrapper layout:
    lora_A.weight [E r, in] (expert-major rows), lora_B.weight [out, r E] (expert-minor columns)."""
    a_weight, b_weight, scaling = lora
    a = a_weight.to(x.dtype).reshape(num_experts, -1, a_weight.shape[-1])  # [E, r, in]
    b = b_weight.to(x.dtype).reshape(b_weight.shape[0], -1, num_experts)  # [out, r, E]
    h = _gmm(x, a.transpose(-2, -1), offs, kernel)  # [S, r]
    return _gmm(h, b.permute(2, 1, 0).contiguous(), offs, kernel) * scaling  # B_e^T: [E, r, out]


def grouped_experts(
    experts,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    gate_up_lora: tuple | None = None,
    down_lora: tuple | None = None,
    kernel: str = "loop",
    compiled: bool = False,
) -> torch.Tensor:
    """The experts of one MoE block with optional LoRA on either fused tensor.

    Same contract and result as ``Qwen3MoeExperts.forward``: ``hidden_states`` [T, H], the router's
    top-k expert ids and weights [T, k]; returns sum_j w_tj * expert_j(x_t). Each lora is
    ``(lora_A.weight, lora_B.weight, scaling)`` of the PEFT ParamWrapper adapting that tensor.
    The routing weight multiplies each row's down-projection input (the projection and its adapter are
    linear, so that is w (W + s B A) x = (W + s B A)(w x)), and the rows are summed back per token.
    ``compiled``: the SiLU product as Inductor kernels (llmft/trainer/fastpath/moe_rows.py).
    """
    with profiled("moe.route"):
        routing = Routing(top_k_index, experts.num_experts)
    rows = routing.gather(hidden_states.to(compute_dtype(experts)))  # [S, H], S = T k
    offs = routing.offs
    gate_up = _frozen_linear(rows, experts, "gate_up_proj", offs, kernel)
    if gate_up_lora is not None:
        gate_up = gate_up + _lora_delta(rows, gate_up_lora, offs, kernel, experts.num_experts)
    with profiled("moe.route"):
        w = routing.weights(top_k_weights)
    inner = swiglu_scaled(experts.act_fn, gate_up, w, compiled=compiled)
    out = _frozen_linear(inner, experts, "down_proj", offs, kernel)
    if down_lora is not None:
        out = out + _lora_delta(inner, down_lora, offs, kernel, experts.num_experts)
    return routing.combine(out).to(hidden_states.dtype)


# ----------------------------------------------------------------------------- swapping it in


def why_not_grouped(experts) -> str | None:
    """None when ``grouped_experts`` reproduces this experts module, else the reason."""
    if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") and hasattr(experts, "act_fn")):
        return f"{type(experts).__name__} has no fused gate_up_proj/down_proj"
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
        return "transposed or biased expert weights"
    if not getattr(experts, "is_concatenated", True) or not getattr(experts, "has_gate", True):
        return "interleaved or ungated expert weights"
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
        return "a custom gate activation"
    return None


def _adapter(wrapper) -> tuple | None:
    """(lora_A.weight, lora_B.weight, scaling) of the one active, unmerged adapter, else None."""
    active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
    if wrapper.disable_adapters or wrapper.merged or len(active) != 1:
        return None
    if not getattr(wrapper, "_did_swap_in_out_features", False):
        return None  # [E, in, out] layouts: keep PEFT's forward
    name = active[0]
    return wrapper.lora_A[name].weight, wrapper.lora_B[name].weight, wrapper.scaling[name]


def _lora_experts_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    wrappers = expert_wrappers(self)
    loras = {name: _adapter(w) for name, w in wrappers.items()}
    if args or kwargs or any(v is None for v in loras.values()):
        return self._llmft_peft_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    return grouped_experts(
        base_experts(self),
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up_lora=loras.get("gate_up_proj"),
        down_lora=loras.get("down_proj"),
        kernel=self._llmft_kernel,
        compiled=self._llmft_compiled,
    )


def _plain_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    kernel, compiled = self._llmft_kernel, self._llmft_compiled
    return grouped_experts(self, hidden_states, top_k_index, top_k_weights, kernel=kernel, compiled=compiled)


def _kernel_for(experts, rank: int) -> str:
    state = _quant_state(experts, "down_proj")
    _, hidden, inner = state.shape if state is not None else experts.down_proj.shape
    widths = (hidden, inner, 2 * inner) + ((rank,) if rank else ())
    device = experts.parametrizations.down_proj.original.device if state is not None else experts.down_proj.device
    return grouped_kernel(compute_dtype(experts), device, widths)


def swap_grouped_experts(model, compile_rows: bool = False) -> dict:
    """Route every MoE block's experts through :func:`grouped_experts` where that is needed:
    experts carrying PEFT LoRA (instead of PEFT's merged-weight parametrization) and 4-bit
    experts (dequantized per use). Frozen bf16 experts keep transformers' own implementation.
    ``compile_rows``: the SiLU product as Inductor kernels (on CUDA with compiled layers).
    Returns counts, the kernel and any block left alone with its reason. Idempotent."""
    report: dict[str, Any] = {"lora_experts": 0, "grouped_4bit": 0, "kernel": None, "kept": {}}
    report["rows_compiled"] = compile_rows
    for block in moe_blocks(model):
        outer, experts = block.experts, base_experts(block.experts)
        if hasattr(outer, "_llmft_kernel"):
            report["lora_experts" if outer is not experts else "grouped_4bit"] += 1
            continue
        wrappers = expert_wrappers(outer)
        if not wrappers and not getattr(experts, "_llmft_4bit", False):
            continue
        reason = why_not_grouped(experts)
        if reason:
            report["kept"][type(experts).__name__] = reason
            continue
        rank = max((w.r[n] for w in wrappers.values() for n in w.r), default=0)
        outer._llmft_kernel = report["kernel"] = _kernel_for(experts, rank)
        outer._llmft_compiled = compile_rows
        if wrappers:
            outer._llmft_peft_forward = outer.forward
            outer.forward = types.MethodType(_lora_experts_forward, outer)
            report["lora_experts"] += 1
        else:
            outer.forward = types.MethodType(_plain_experts_forward, outer)
            report["grouped_4bit"] += 1
        # Eager inside compiled decoder layers: Inductor (torch 2.11) fed _grouped_mm an adapter buffer laid out
        # expert-fastest ("Invalid strides/sizes", H100 run of llmft/benchmarks/gpu/check_moe.py), and bnb's
        # dequantization is eager anyway. The grouped matmuls are the layer's bulk; the rest stays compiled.
        outer.forward = torch.compiler.disable(outer.forward)
    return report


# ----------------------------------------------------------------------------- router, 4-bit, report


def quantize_experts_4bit(model, *, quant_type: str = "nf4", double_quant: bool = True) -> int:
    """Store every experts module's fused tensors in 4 bits (bitsandbytes parametrization); returns
    how many modules. Call before PEFT touches the model (its kbit preparation would upcast the
    bf16 experts to fp32). Each tensor is quantized and its bf16 copy freed one at a time."""
    blocks = moe_blocks(model)
    if not blocks:
        return 0
    # heavy: bitsandbytes
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    count = 0
    shared: dict[tuple, type] = {}
    for block in blocks:
        experts = base_experts(block.experts)
        if getattr(experts, "_llmft_4bit", False):
            continue
        for name in ("gate_up_proj", "down_proj"):
            kind = cast(Literal["nf4", "fp4"], quant_type)  # one of the two: QLoRAConfig checks it
            replace_parameter_4bit(experts, name, compress_statistics=double_quant, quant_type=kind)
        experts._llmft_4bit = True
        _share_parametrized_class(experts, shared)
        count += 1
    if count and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return count


def _share_parametrized_class(module, shared: dict) -> None:
    """One class for every module parametrized the same way. ``torch.nn.utils.parametrize`` gives each
    module its own ``Parametrized<Class>`` (with one property per parametrized tensor, all alike), and
    compiled code guards on the class of the module it calls: 48 layers of 4-bit experts meant 48
    recompiles of the MoE block, past dynamo's recompile limit, and eager layers from there on (H200
    run of 2026-11-26, 48 layers: ``hit config.recompile_limit (64)``, 8,349 tokens/s)."""
    cls = type(module)
    key = (cls.__bases__[0], tuple(sorted(module.parametrizations.keys())))
    module.__class__ = shared.setdefault(key, cls)


def apply_moe(
    model,
    *,
    fuse_lora: bool = True,
    freeze_router: bool = True,
    aux_coef: float | None = None,
    compile_rows: bool = False,
) -> dict | None:
    """Everything MoE-specific once the method is applied: routers frozen (LoRA/QLoRA), grouped
    experts swapped in (``fuse_lora``; always for 4-bit experts; ``compile_rows``: their SiLU product
    compiled), the load-balancing loss armed when the model config asks for it. Returns the
    ``moe`` entry of the fast-path report; None for a dense model."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    config = model_config(model)
    report = {
        "layers": len(blocks),
        "experts": int(getattr(config, "num_experts", 0) or 0),
        "top_k": int(getattr(config, "num_experts_per_tok", 0) or 0),
        "experts_implementation": getattr(config, "_experts_implementation", None),
        "routers_frozen": freeze_routers(model) if freeze_router else 0,
        "experts_4bit": sum(1 for b in blocks if getattr(base_experts(b.experts), "_llmft_4bit", False)),
    }
    if fuse_lora or report["experts_4bit"]:
        report.update(swap_grouped_experts(model, compile_rows=compile_rows))
    if report["experts_4bit"]:
        report["frozen_fp32_to_bf16"] = frozen_to_compute_dtype(model, compute_dtype(base_experts(blocks[0].experts)))
    report["router_aux_loss_coef"] = install_router_aux(model, aux_coef)
    return report


def frozen_to_compute_dtype(model, dtype: torch.dtype) -> int:
    """Frozen fp32 base parameters (what PEFT's ``prepare_model_for_kbit_training`` makes of the
    embeddings, norms, router and lm_head) back to the compute dtype, so a QLoRA model computes in
    bf16 end to end: with them in fp32 every activation after the first norm, and the lm_head
    matmul of the loss, run in fp32 (3x slower in the 4-layer H100 smoke run, BENCHMARKS.md). Adapters
    stay fp32. Returns how many parameters were cast."""
    count = 0
    for name, param in model.named_parameters():
        if not param.requires_grad and param.dtype == torch.float32 and "lora_" not in name:
            param.data = param.data.to(dtype)
            count += 1
    return count


# ----------------------------------------------------------------------------- 4-bit helpers


def _quant_state(module, name: str):
    """The bitsandbytes QuantState of a 4-bit parametrized tensor, else None (reading the
    parameter itself would dequantize it)."""
    parametrizations = getattr(module, "parametrizations", None)
    if parametrizations is None or name not in parametrizations:
        return None
    return next((p.quant_state for p in parametrizations[name] if hasattr(p, "quant_state")), None)


def compute_dtype(experts) -> torch.dtype:
    """The dtype the expert matmuls run in: the weights' own (a 4-bit tensor's original dtype)."""
    state = _quant_state(experts, "gate_up_proj")
    return state.dtype if state is not None else experts.gate_up_proj.dtype
