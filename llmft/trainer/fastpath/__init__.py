"""The trainer's fast path on GPU. Each piece is exact, and on by default on CUDA:

- ``attention``: ``llmft_varlen`` per-document causal attention for packed rows
  (FlashAttention varlen kernel on CUDA; per-document SDPA elsewhere),
  registered with transformers' AttentionInterface.
- ``loss``: fused linear cross-entropy over supervised positions only, chunked,
  never materializing full-vocab logits (the lm_head gathered under DeepSpeed ZeRO-3).
- ``lora``: a fused LoRA linear (LoRA dropout included) swapped into PEFT's lora.Linear modules.
- ``lora_dropout``: LoRA dropout masks as a function of (seed words, row, column) (Philox,
  ``dropout_mask``), made in registers by Triton kernels on CUDA (``lora_dropout_triton``): no mask
  stored, no extra input read.
- ``lora_groups``: q/k/v and gate/up (one shared input) as one fused node each.
- ``compile``: torch.compile of the decoder layers in place.
- ``resolve``: ``auto`` settings -> which pieces apply to this device, method and model, and why
  not; the typed decision (``FastPath``, returned by trainer.model.load_model) and its ``fast path:`` log line.
- ``settings``: the ``auto`` settings resolved once per run (config.json, data manifest, free memory), with
  the memory model of a step (llmft/trainer/sizing/memory.py, torch-free: the plan step runs it too).
- ``moe``: grouped experts, expert LoRA without the merged weight, 4-bit experts.
- :func:`apply_kernels`: one call that switches the model-level pieces on for a model.

Importing the package registers ``llmft_varlen`` with transformers, so
``model.attn_implementation=llmft_varlen`` resolves at load time. The kernel choices that are
not config settings (fused LoRA's form, GQA into the varlen kernel) are arguments
(:func:`apply_kernels`' ``lora_mode``, ``attention.register``'s ``gqa_mode``), not module globals.

What a run needs for correctness on any path lives outside this package: the FLOP count and MFU
(llmft/trainer/flops.py), an MoE model's LoRA targets and frozen routers (llmft/trainer/moe_model.py) and its
load-balancing loss (llmft/trainer/moe_aux.py), the packed batch's document boundaries and the loss
(llmft/trainer/loss.py). The ``auto`` settings (resolve, settings) are here, so the trainer imports
this package on every run; optional dependencies inside it (Triton, bitsandbytes, DeepSpeed) are
imported where they are used.
"""

from __future__ import annotations

from llmft.trainer.fastpath.attention import register as _register_attention
from llmft.trainer.fastpath.compile import compile_decoder_layers
from llmft.trainer.fastpath.lora import count_fused, fuse_lora_linears
from llmft.trainer.fastpath.lora_groups import count_grouped, group_lora_projections

_register_attention()  # on import: trainer.model imports this package for a non-builtin attention name


def apply_kernels(
    model,
    *,
    compile_layers: bool,
    fuse_lora: bool = True,
    group_lora: bool = True,
    compile_cache_dir: str | None = None,
    lora_mode: str = "auto",
) -> dict:
    """Switch on the model-level fast path: fused LoRA linears (exact; PEFT models only; ``lora_mode``
    one of lora.LORA_MODES), grouped sibling projections, and compiled decoder layers. Returns what was
    done, for the run log."""
    report: dict = {"fused_lora": 0, "lora_kept": {}, "grouped_lora": 0, "compiled_layers": 0}
    if fuse_lora and hasattr(model, "peft_config"):
        report["lora_kept"] = fuse_lora_linears(model, lora_mode)
        report["fused_lora"] = count_fused(model)
        if group_lora:
            ungrouped = group_lora_projections(model)
            report["grouped_lora"] = count_grouped(model)
            if ungrouped:
                report["lora_ungrouped"] = ungrouped
    if compile_layers:
        report["compiled_layers"] = compile_decoder_layers(model, cache_dir=compile_cache_dir)
    return report
