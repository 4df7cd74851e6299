"""Fused linear cross-entropy: the loss of ``hidden @ lm_head.T`` without ever
holding the full (tokens x vocab) logits, in fp32 or otherwise.

Only supervised positions (target != ignore_index) reach the head at all: the
masked prompt tokens of SFT data (35% in the benchmark's profile) cost no
lm_head FLOPs. The supervised rows are processed ``chunk_size`` at a time: one
bf16 matmul for the chunk's logits, then one fused pass (torch.compile'd on
CUDA) computing the per-row log-sum-exp, the loss and the logits' gradient
``(softmax - onehot) * scale`` in the logits' dtype; that gradient is
immediately multiplied back into the hidden-state gradient (and, when the head
is trained, the weight gradient, accumulated in fp32). The backward pass only
scales the gradients computed here, so the chunk's logits die inside the
forward pass. Peak extra memory: one chunk of logits plus its gradient.

:func:`lm_head_bypassed` lets a model wrapped in PEFT and/or DDP return its
final hidden states in place of logits, so the loss can be fused while the
forward still goes through every wrapper's hooks.

Under DeepSpeed ZeRO-3 the head's weight is a partition on each rank; the loss
gathers it (``deepspeed.zero.GatheredParameters``) for the length of the fused
loss's forward only: that forward already computes every gradient the backward
hands out, so the full weight's values are never needed again and are released at once.
A trained head of its own (untied, the Llama shape, full fine-tuning) is gathered once
more in backward, until its gradient is accumulated: torch accumulates a gradient into
a tensor of the parameter's current shape, and a released partition is empty (the
error was "The size of tensor a (0) must match the size of tensor b (4096)"). A tied
head needs no such gather: its gradient is accumulated together with the embedding's,
while DeepSpeed holds the embedding gathered for its own backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from llmft.trainer.data.shards import IGNORE_INDEX

_COMPILED_CHUNK = None


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, grad_scale: float):
    """Sum of the rows' NLL (fp32) and d(scale * NLL)/d(logits) in the logits' dtype."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    target_logit = x.gather(1, targets.unsqueeze(1)).squeeze(1)
    loss_sum = (lse - target_logit).sum()
    probs = torch.exp(x - lse.unsqueeze(1))
    columns = torch.arange(x.shape[1], device=x.device)
    onehot = (columns.unsqueeze(0) == targets.unsqueeze(1)).to(x.dtype)  # fused, never materialized when compiled
    grad = ((probs - onehot) * grad_scale).to(logits.dtype)
    return loss_sum, grad


def _chunk_function(device: torch.device, compile_chunk: bool | None):
    global _COMPILED_CHUNK
    use_compile = device.type == "cuda" if compile_chunk is None else compile_chunk
    if not use_compile:
        return _chunk_loss_and_grad
    if _COMPILED_CHUNK is None:
        _COMPILED_CHUNK = torch.compile(_chunk_loss_and_grad, dynamic=True)
    return _COMPILED_CHUNK


def _forward_chunks(hidden, weight, targets, select, chunk_size, mean, compile_chunk):
    """Loss, d loss / d selected rows, d loss / d weight (fp32 or None), and the selected row indices."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if select is None:
        select = torch.nonzero(flat_targets != IGNORE_INDEX).reshape(-1)  # one host sync
    select = select.to(device=hidden.device, dtype=torch.long)
    count = select.numel()
    rows = flat_hidden.index_select(0, select)
    row_targets = flat_targets.index_select(0, select).long()
    scale = 1.0 / count if (mean and count) else 1.0
    chunk_fn = _chunk_function(hidden.device, compile_chunk)
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    weight_grad = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if weight.requires_grad else None
    loss = torch.zeros((), dtype=acc_dtype, device=hidden.device)
    compute_weight = weight.detach().to(hidden.dtype)
    grad_rows = torch.empty_like(rows)
    for start in range(0, count, chunk_size):
        end = min(start + chunk_size, count)
        logits = rows[start:end] @ compute_weight.t()
        chunk_loss, grad_logits = chunk_fn(logits, row_targets[start:end], scale)
        del logits
        loss += chunk_loss
        torch.mm(grad_logits, compute_weight, out=grad_rows[start:end])
        if weight_grad is not None:
            weight_grad += (grad_logits.t() @ rows[start:end]).to(acc_dtype)
    return loss * scale, grad_rows, weight_grad, select


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, select, chunk_size, mean, compile_chunk, regather_for_grad=False):
        device_type = hidden.device.type
        compute_dtype = (
            torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        )
        with torch.autocast(device_type, enabled=False):
            loss, grad_rows, weight_grad, select = _forward_chunks(
                hidden.to(compute_dtype), weight, targets, select, chunk_size, mean, compile_chunk
            )
        ctx.save_for_backward(select, grad_rows, weight_grad if weight_grad is not None else torch.empty(0))
        ctx.hidden_shape = hidden.shape
        ctx.hidden_dtype = hidden.dtype
        ctx.weight_dtype = weight.dtype
        ctx.has_weight_grad = weight_grad is not None
        ctx.zero3_weight = weight if (regather_for_grad and ctx.has_weight_grad and hasattr(weight, "ds_id")) else None
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        select, grad_rows, weight_grad = ctx.saved_tensors
        grad_hidden = torch.zeros(ctx.hidden_shape, dtype=ctx.hidden_dtype, device=grad_rows.device)
        flat = grad_hidden.view(-1, ctx.hidden_shape[-1])
        flat.index_copy_(0, select, (grad_rows * grad_output.to(grad_rows.dtype)).to(ctx.hidden_dtype))
        grad_weight = (weight_grad * grad_output).to(ctx.weight_dtype) if ctx.has_weight_grad else None
        if ctx.zero3_weight is not None:
            gather_until_accumulated(ctx.zero3_weight)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "mean",
    chunk_size: int = 4096,
    select: torch.Tensor | None = None,
    compile_chunk: bool | None = None,
    regather_for_grad: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets`` (already shifted; -100 = ignore).

    hidden: (..., d); weight: (vocab, d) (the lm_head weight, tied or not; it gets
    a gradient when it requires one); targets: (...) int. ``reduction`` is
    ``mean`` (over supervised tokens) or ``sum`` (divide by a global token count
    yourself, e.g. across gradient-accumulation steps and ranks). ``select``:
    optional precomputed flat indices of the supervised positions (saves the
    one host sync that finding them on the device costs). ``regather_for_grad``: a DeepSpeed
    ZeRO-3 ``weight`` that no other module uses is gathered again in backward until its gradient
    is accumulated (:func:`gather_until_accumulated`); leave it off for a tied head.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on positions")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _FusedLinearCrossEntropy.apply(
        hidden, weight, targets, select, int(chunk_size), reduction == "mean", compile_chunk, regather_for_grad
    )


def shift_packed_labels(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets for packed rows: targets[i] = labels[i+1] inside a document, else -100.

    ``labels`` are unshifted (as stored in the shards: labels[i] is token i or
    -100); ``position_ids`` restart at 0 where a document starts, so the last
    token of a document never learns to predict the next document's first.
    """
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[..., :-1] = labels[..., 1:]
    starts_next = position_ids[..., 1:] == 0
    targets[..., :-1] = targets[..., :-1].masked_fill(starts_next, IGNORE_INDEX)
    return targets


def _return_input(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states


@contextlib.contextmanager
def lm_head_bypassed(model: torch.nn.Module) -> Iterator[torch.nn.Linear]:
    """Within the block, the model's output head returns its input (final hidden states).

    Yields the head module, whose ``.weight`` is what the fused loss needs (gather it
    with :func:`gathered_weight` under DeepSpeed ZeRO-3). Works through PEFT and DDP
    wrappers (the forward still runs through them). Refuses heads it cannot bypass
    exactly: biased or adapter-wrapped heads.
    """
    head = _output_head(model)
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise ValueError(
            f"fused loss needs a plain bias-free nn.Linear output head, found {type(head).__name__}; "
            "set kernels.fused_loss=false (or keep lm_head out of the LoRA target modules)"
        )
    head.forward = _return_input
    try:
        yield head
    finally:
        del head.forward


def gathered_weight(weight: torch.Tensor):
    """Context in which a DeepSpeed ZeRO-3 partitioned ``weight`` holds its full value on every rank
    (read-only; released on exit); a no-op for an ordinary tensor."""
    if not hasattr(weight, "ds_id"):
        return contextlib.nullcontext()
    # heavy: deepspeed
    import deepspeed

    return deepspeed.zero.GatheredParameters([weight], modifier_rank=None)


def gather_until_accumulated(param: torch.Tensor) -> None:
    """DeepSpeed ZeRO-3: gather a released ``param`` now and release it again right after its
    gradient is accumulated (after DeepSpeed's own post-accumulate hook, registered first, has
    reduced it). Autograd's AccumulateGrad copies a new gradient into the parameter's current
    shape (torch/csrc/autograd/functions/accumulate_grad.h, clone_obey_contract), which is empty
    while the parameter is a released partition. A no-op unless ``param`` is released."""
    # heavy: deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if getattr(param, "ds_status", None) != ZeroParamStatus.NOT_AVAILABLE:
        return
    zero_param: Any = param  # DeepSpeed adds all_gather/partition to its parameters
    zero_param.all_gather()
    handles: list = []

    def release(p: Any) -> None:
        handles.pop().remove()
        p.partition()

    handles.append(param.register_post_accumulate_grad_hook(release))


def _output_head(model: torch.nn.Module) -> torch.nn.Module:
    inner: Any = getattr(model, "module", model)  # DDP
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output embeddings (lm_head)")
    return head


def fused_causal_lm_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "sum",
    select: torch.Tensor | None = None,
    chunk_size: int = 4096,
    **forward_kwargs,
) -> torch.Tensor:
    """Forward ``model`` (HF causal LM, possibly PEFT/DDP-wrapped) and return the fused loss.

    ``targets`` are the shifted next-token labels (see :func:`shift_packed_labels`);
    ``forward_kwargs`` go to the model (position_ids, the packed-attention kwargs, ...).
    """
    with lm_head_bypassed(model) as head:
        hidden = model(input_ids=input_ids, use_cache=False, **forward_kwargs).logits
    inner: Any = getattr(model, "module", model)  # DDP
    inputs = inner.get_input_embeddings()
    untied = inputs is None or inputs.weight is not head.weight
    with gathered_weight(head.weight):
        return fused_linear_cross_entropy(
            hidden,
            head.weight,
            targets,
            reduction=reduction,
            select=select,
            chunk_size=chunk_size,
            regather_for_grad=untied,
        )
