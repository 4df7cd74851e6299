"""The trainer's fast path on GPU. Each piece is exact, and on by default on CUDA:

- ``attention``: ``llmft_varlen`` per-document causal attention for packed rows
  (FlashAttention varlen kernel on CUDA; per-document SDPA elsewhere),
  registered with transformers' AttentionInterface.
- ``loss``: fused linear cross-entropy over supervised positions only, chunked,
  never materializing full-vocab logits (the lm_head gathered under DeepSpeed ZeRO-3).
- ``lora``: a fused LoRA linear (LoRA dropout included) swapped into PEFT's lora.Linear modules.
- ``lora_dropout``: LoRA dropout masks as a function of (seed words, row, column) (Philox), made in
  registers by Triton kernels on CUDA (``lora_dropout_triton``): no mask stored, no extra input read.
- ``lora_groups``: q/k/v and gate/up (one shared input) as one fused node each.
- ``compile``: torch.compile of the decoder layers in place.
- ``resolve``: ``auto`` settings -> which pieces apply to this device, method and model, and why
  not; the typed decision (``FastPath``, returned by trainer.model.load_model) and its ``fast path:`` log line.
- ``memory``: the memory model of a step; the micro batch and checkpointed layers that fit.
- ``settings``: both of the above resolved once per run (config.json, data manifest, free memory).
- ``flops``: model FLOPs per step (LoRA 4N + adapters, full 6N, causal attention
  per document) for tokens/s -> MFU, shared by the benchmark and the step logs.
- ``apply``: one call that switches the model-level pieces on for a model.

Importing the package registers ``llmft_varlen`` with transformers (when it is
installed), so ``model.attn_implementation=llmft_varlen`` resolves at load time.
"""

from __future__ import annotations

import logging

_log = logging.getLogger(__name__)

try:  # register the attention on import (trainer.model imports this package for non-builtin names)
    from llmft.trainer.fastpath.attention import register as _register_attention

    _register_attention()
except ImportError as _exc:  # transformers missing: the pure-Python pieces (flops) still work
    _log.debug("llmft_varlen not registered: %s", _exc)


def apply_kernels(
    model,
    *,
    compile_layers: bool,
    fuse_lora: bool = True,
    group_lora: bool = True,
    compile_cache_dir: str | None = None,
) -> dict:
    """Switch on the model-level fast path: fused LoRA linears (exact; PEFT models only), grouped
    sibling projections, and compiled decoder layers. Returns what was done, for the run log."""
    report: dict = {"fused_lora": 0, "lora_kept": {}, "grouped_lora": 0, "compiled_layers": 0}
    if fuse_lora and hasattr(model, "peft_config"):
        from llmft.trainer.fastpath.lora import count_fused, fuse_lora_linears

        report["lora_kept"] = fuse_lora_linears(model)
        report["fused_lora"] = count_fused(model)
        if group_lora:
            from llmft.trainer.fastpath.lora_groups import count_grouped, group_lora_projections

            ungrouped = group_lora_projections(model)
            report["grouped_lora"] = count_grouped(model)
            if ungrouped:
                report["lora_ungrouped"] = ungrouped
    if compile_layers:
        from llmft.trainer.fastpath.compile import compile_decoder_layers

        report["compiled_layers"] = compile_decoder_layers(model, cache_dir=compile_cache_dir)
    return report


def packed_forward_kwargs(batch: dict) -> dict:
    """Model kwargs of a packed micro batch (trainer.data.loader's to_torch dict): positions plus
    the document boundaries that ``llmft_varlen`` (and flash-attention) read; others ignore them."""
    from llmft.trainer.fastpath.attention import bucket_max_length

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


def fused_token_nll_sum(model, batch: dict):
    """Drop-in for trainer.loss.token_nll_sum: the SUM of next-token NLL over supervised targets
    (0-d float32), through the fused linear cross-entropy (no full-vocab logits)."""
    from llmft.trainer.fastpath.loss import fused_causal_lm_loss

    return fused_causal_lm_loss(
        model,
        batch["input_ids"],
        batch["targets"],
        reduction="sum",
        select=batch.get("supervised"),
        **packed_forward_kwargs(batch),
    ).float()
