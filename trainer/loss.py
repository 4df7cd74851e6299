"""The one place the training and evaluation loss is computed.

``token_nll_sum(model, batch)`` returns the SUM of next-token negative
log-likelihoods over the supervised targets of one flattened micro batch (a 0-d
float32 tensor on the device; no host sync). Callers divide by the supervised
target count of the whole global batch, so the result does not depend on how
ranks and micro batches split it.

A fused loss (``kernels.fused_loss``, ``auto`` = on on CUDA; :func:`loss_fn_for` reads the
resolved choice from the model's :class:`~llmft.trainer.fastpath.resolve.FastPath`) swaps in
``llmft.trainer.fastpath.fused_token_nll_sum``, which has the same signature and returns
the same quantity without materialising the full [tokens, vocab] logits.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from llmft.trainer.data.shards import IGNORE_INDEX

if TYPE_CHECKING:
    from llmft.trainer.fastpath.resolve import FastPath


def forward_inputs(batch: dict, varlen: bool = False) -> dict:
    """Model kwargs for a packed row. use_cache=False is required: transformers skips its
    packed-sequence (per-document) masking whenever a KV cache exists (platform facts).
    ``varlen`` adds the document boundaries (cu_seq_lens) that varlen attention kernels read."""
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    if varlen:
        from llmft.trainer.fastpath import packed_forward_kwargs

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


def loss_fn(fused: bool = False, attn_implementation: str = "sdpa"):
    """The token-sum loss selected by ``kernels.fused_loss``; an attention registered by
    trainer.fastpath (not one of transformers' own) also gets the document boundaries. On an MoE
    model whose config asks for it, training forwards also carry the load-balancing loss's gradient
    (per document, per supervised token: trainer/fastpath/moe_aux.py); the value stays the NLL sum."""
    from llmft.trainer.fastpath.moe_aux import with_router_aux_loss

    return with_router_aux_loss(_select_loss_fn(fused, attn_implementation))


def loss_fn_for(fast_path: FastPath | None):
    """The loss the model's fast-path decision (what ``trainer.model.load_model`` returned) selects:
    fused when ``fused_loss`` is on, document boundaries for the attention it runs."""
    if fast_path is None:
        return loss_fn(False, "sdpa")
    return loss_fn(fast_path.fused_loss.on, fast_path.attention)


def _select_loss_fn(fused: bool, attn_implementation: str):
    if not fused:
        from llmft.trainer.model import BUILTIN_ATTENTION

        if attn_implementation in BUILTIN_ATTENTION:
            return token_nll_sum
        return functools.partial(token_nll_sum, varlen=True)
    try:
        from llmft.trainer.fastpath import fused_token_nll_sum
    except ImportError as exc:
        from llmft.trainer.errors import ConfigError

        raise ConfigError(
            f"kernels.fused_loss=true needs trainer.fastpath.fused_token_nll_sum ({exc}); set kernels.fused_loss=false"
        ) from None
    return fused_token_nll_sum
