"""The memory-bound part of an MoE experts call (llmft/trainer/fastpath/moe.py ``grouped_experts``): routing the
(token, slot) pairs to sorted rows and back, and the gated activation with the routing weight.

Profiles of the Qwen3-30B-A3B QLoRA step on one H200 (issue 46, BENCHMARKS.md): with the SiLU product as
separate eager ops it took 1.07 s of a 6.5 s step (0.82 ms forward and 1.96 ms backward per call on
[131k, 768] rows: five to seven times the bytes they must move). On CUDA with compiled layers (``compiled``) it
runs as Inductor kernels, compiled once for any row count (``dynamic=True``) and called from the experts'
eager region (moe.py runs the experts outside the compiled layers): 2x faster per row forward, 1.4x backward
(a hand-written kernel is the next step: the backward still moves about six times its bytes). The
row moves stay eager gathers: compiled as one gather-and-sum reduction they ran 2.3x slower than
``index_select`` + ``sum`` (0.87 s against 0.38 s a step, same bytes).

- :class:`Routing`: offsets from ``searchsorted`` over the sorted ids (``torch.bincount`` on CUDA reads the
  ids' min and max back to the host: two syncs per layer and micro step), the rows gathered and summed back
  by one pair of adjoint gathers (deterministic, no atomics).
- :func:`swiglu_scaled`: ``act(gate) * up * w`` per row, the routing weight applied before the (linear) down
  projection, saving only the gate/up output and ``w`` for the backward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch


def profiled(name: str):
    """A named profiler range (``moe.*``: llmft/benchmarks/gpu/trainer_entry.py sums the GPU time inside
    each) while torch.profiler records, else nothing (no per-call cost on a training step)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- the math, eager or compiled


def gather_sum(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` ([n] -> [n, H]) or, for a 2-D ``index`` [n, k], the sum of the k rows it names (fp32
    accumulation)."""
    rows = x.index_select(0, index.reshape(-1))
    return rows if index.dim() == 1 else rows.view(*index.shape, -1).sum(dim=1)


def swiglu_forward(gate_up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up * w.unsqueeze(-1).to(up.dtype)


def swiglu_backward(gate_up: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate_up, d w) of :func:`swiglu_forward`, computed in fp32 (float64 stays); Inductor fuses it."""
    acc = torch.promote_types(grad.dtype, torch.float32)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    g = grad.to(acc)
    sig = torch.sigmoid(gate)
    act = gate * sig
    grad_w = (g * act * up).sum(-1)
    g = g * w.to(acc).unsqueeze(-1)
    grad_gate = g * up * sig * (1 + gate * (1 - sig))
    return torch.cat([grad_gate, g * act], dim=-1).to(gate_up.dtype), grad_w.to(w.dtype)


def swiglu_backward_eager(gate_up, w, grad) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in the activations' dtype, written in place: three [S, I] temporaries at most (the eager
    path's memory; fp32 temporaries of the formula above would be six of twice the size)."""
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.empty_like(gate_up)
    grad_gate, grad_up = out.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate)
    acc = torch.promote_types(grad.dtype, torch.float32)  # fp32 sums for bf16, float64 stays
    grad_w = (grad * act).mul_(up).sum(-1, dtype=acc).to(w.dtype)
    g = grad * w.unsqueeze(-1).to(grad.dtype)
    torch.mul(g, act, out=grad_up)
    del act
    torch.ops.aten.silu_backward.grad_input(g.mul_(up), gate, grad_input=grad_gate)
    return out, grad_w


@functools.cache
def _compiled(name: str):
    """The Inductor-compiled form of one of this module's functions (once per process, any row count)."""
    table: dict[str, Callable[..., Any]] = {"swiglu_forward": swiglu_forward, "swiglu_backward": swiglu_backward}
    return torch.compile(table[name], dynamic=True)


def _fn(name: str, compiled: bool):
    if compiled:
        return _compiled(name)
    return {"swiglu_forward": swiglu_forward, "swiglu_backward": swiglu_backward_eager}[name]


# ----------------------------------------------------------------------------- routing


class Routing:
    """Where each (token, slot) pair of a top-k routing goes, sorted by expert, computed on the device
    without a host sync.

    ``source[s]``: the token of sorted row s; ``inverse[t, j]``: the sorted row of token t's j-th expert;
    ``offs[e]``: the end of expert e's rows (int32, what ``grouped_mm`` takes)."""

    def __init__(self, top_k_index: torch.Tensor, num_experts: int):
        tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        self.order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=flat.dtype)
        self.offs = torch.searchsorted(flat.index_select(0, self.order), bounds).to(torch.int32)
        self.source = torch.div(self.order, top_k, rounding_mode="floor")
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.order.numel(), device=flat.device)
        self.inverse = inverse.view(tokens, top_k)

    def gather(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, H] -> the sorted rows [T k, H] (row s is token ``source[s]``)."""
        with profiled("moe.route"):
            return _RowsGather.apply(hidden_states, self.source, self.inverse, "moe.bwd.route")

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The sorted rows [T k, H] -> [T, H], each token the sum of its k rows (fp32 accumulation)."""
        with profiled("moe.combine"):
            return _RowsGather.apply(rows, self.inverse, self.source, "moe.bwd.combine")

    def weights(self, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routing weight of each sorted row, [T k]."""
        return top_k_weights.reshape(-1).index_select(0, self.order)


class _RowsGather(torch.autograd.Function):
    """Routing's two row moves, each the other's adjoint: gathering rows by ``index`` (1-D: one source row
    each; 2-D [n, k]: the sum of k rows), whose gradient is the move by ``adjoint``. Both directions are
    plain gathers (deterministic, no atomics): the sorted order is a permutation of the (token, slot) pairs.
    """

    @staticmethod
    def forward(ctx, x, index, adjoint, label):
        ctx.save_for_backward(adjoint)
        ctx.label = label
        return gather_sum(x, index)

    @staticmethod
    def backward(ctx, grad):
        (adjoint,) = ctx.saved_tensors
        with profiled(ctx.label):
            moved = gather_sum(grad.contiguous(), adjoint)
        return moved, None, None, None


class _SwiGLUScaled(torch.autograd.Function):
    """``act(gate) * up * w`` per sorted row (``gate_up`` [S, 2I] from the fused gate/up matmul, ``w`` [S] the
    routing weights). Saves only ``gate_up`` and ``w`` (the SiLU and the products are recomputed in
    backward): 2I values a row where separate ops keep gate, act(gate), up and the [S, H] expert output."""

    @staticmethod
    def forward(ctx, gate_up, w, compiled):
        ctx.save_for_backward(gate_up, w)
        ctx.compiled = compiled
        with profiled("moe.swiglu"):
            return _fn("swiglu_forward", compiled)(gate_up.detach(), w.detach())

    @staticmethod
    def backward(ctx, grad):
        gate_up, w = ctx.saved_tensors
        with profiled("moe.bwd.swiglu"):
            grad_gate_up, grad_w = _fn("swiglu_backward", ctx.compiled)(gate_up, w, grad.contiguous())
        return grad_gate_up, grad_w if ctx.needs_input_grad[1] else None, None


def is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def swiglu_scaled(act_fn, gate_up: torch.Tensor, w: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """``act_fn(gate) * up * w`` per row: the saving node for SiLU (Qwen3-MoE, Mixtral), plain ops otherwise."""
    if is_silu(act_fn):
        return _SwiGLUScaled.apply(gate_up, w, compiled)
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up * w.unsqueeze(-1).to(up.dtype)
