"""The one place the training and evaluation loss is computed.

``token_nll_sum(model, batch)`` returns the SUM of next-token negative
log-likelihoods over the supervised targets of one flattened micro batch (a 0-d
float32 tensor on the device; no host sync). Callers divide by the supervised
target count of the whole global batch, so the result does not depend on how
ranks and micro batches split it.

A fused loss (``kernels.fused_loss``, ``auto`` = on on CUDA; :func:`loss_fn` takes the choice the
model's fast-path decision resolved, trainer.fastpath.resolve.FastPath) swaps in
:func:`fused_token_nll_sum` (trainer.fastpath's fused linear cross-entropy), which has the same
signature and returns the same quantity without materialising the full [tokens, vocab] logits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from llmft.trainer.data.shards import IGNORE_INDEX
from llmft.trainer.moe_aux import with_router_aux_loss

# transformers' own attention implementations: they read no document boundaries from the loss's kwargs.
BUILTIN_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "paged_attention")


def bucket_max_length(n: int) -> int:
    """Round a longest-document length up to a power of two (>= 128).

    Varlen kernels only size their grid from it, so rounding up is cheap, and a
    handful of distinct values keeps ``torch.compile`` from recompiling.
    """
    return max(128, 1 << (int(n) - 1).bit_length())


def packed_forward_kwargs(batch: dict) -> dict:
    """Model kwargs of a packed micro batch (trainer.data.loader's to_torch dict): positions plus
    the document boundaries that ``llmft_varlen`` (and flash-attention) read; others ignore them."""
    kwargs = {"position_ids": batch["position_ids"]}
    if batch.get("cu_seqlens") is not None:
        longest = bucket_max_length(int(batch.get("max_seqlen") or batch["input_ids"].shape[-1]))
        kwargs.update(
            cu_seq_lens_q=batch["cu_seqlens"],
            cu_seq_lens_k=batch["cu_seqlens"],
            max_length_q=longest,
            max_length_k=longest,
        )
    return kwargs


def forward_inputs(batch: dict, varlen: bool = False) -> dict:
    """Model kwargs for a packed row. use_cache=False is required: transformers skips its
    packed-sequence (per-document) masking whenever a KV cache exists (platform facts).
    ``varlen`` adds the document boundaries (cu_seq_lens) that varlen attention kernels read."""
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    if varlen:
        kwargs.update(packed_forward_kwargs(batch))
    return kwargs


def token_nll_sum(model, batch: dict, *, varlen: bool = False) -> torch.Tensor:
    """Sum of cross-entropy over supervised targets (float32 logits)."""
    logits = model(**forward_inputs(batch, varlen)).logits
    return F.cross_entropy(
        logits.view(-1, logits.size(-1)).float(),
        batch["targets"].view(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def fused_token_nll_sum(model, batch: dict) -> torch.Tensor:
    """Drop-in for :func:`token_nll_sum`: the SUM of next-token NLL over supervised targets (0-d
    float32), through trainer.fastpath's fused linear cross-entropy (no full-vocab logits)."""
    # Not at module level: what a run needs for correctness does not import the fast path (issue 26);
    # importing it registers its attention with transformers.
    # heavy: transformers
    from llmft.trainer.fastpath.loss import fused_causal_lm_loss  # only where kernels.fused_loss resolved on

    return fused_causal_lm_loss(
        model,
        batch["input_ids"],
        batch["targets"],
        reduction="sum",
        select=batch.get("supervised"),
        **packed_forward_kwargs(batch),
    ).float()


def loss_fn(fused: bool = False, attn_implementation: str = "sdpa"):
    """The token-sum loss selected by ``kernels.fused_loss``; an attention registered by
    trainer.fastpath (not one of transformers' own) also gets the document boundaries. On an MoE
    model whose config asks for it, training forwards also carry the load-balancing loss's gradient
    (per document, per supervised token: llmft/trainer/moe_aux.py); the value stays the NLL sum."""

    return with_router_aux_loss(_select_loss_fn(fused, attn_implementation))


def _select_loss_fn(fused: bool, attn_implementation: str):
    if fused:
        return fused_token_nll_sum
    if attn_implementation in BUILTIN_ATTENTION:
        return token_nll_sum
    return functools.partial(token_nll_sum, varlen=True)
