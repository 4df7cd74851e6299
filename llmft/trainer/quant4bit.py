"""4-bit linears after loading: what transformers' ``BitsAndBytesConfig(load_in_4bit=True)`` makes of a
model's ``nn.Linear`` layers while loading, done to a model already loaded in bf16.

Used for QLoRA over an FP8 checkpoint (llmft/trainer/fp8.py): transformers refuses a
``BitsAndBytesConfig`` for a model whose config says FP8, so the base is loaded dequantized to bf16
(``FineGrainedFP8Config(dequantize=True)``) onto the GPU and its linears are then stored in 4 bits here,
without the bf16 copy of the whole checkpoint on disk that loading it through bitsandbytes needed (61 GB
for Qwen3-30B-A3B, beside its 31 GB FP8 original).

Which layers: as transformers' bitsandbytes quantizer (``quantizer_bnb_4bit.py``
``_process_model_before_weight_loading`` -> ``replace_with_bnb_linear``, transformers 5.17-5.24): every
module whose type is exactly ``nn.Linear``, except the output embeddings (``lm_head``), the config's
``llm_int8_skip_modules`` and the model's ``_keep_in_fp32_modules``. The weight becomes a
``bitsandbytes.nn.Params4bit`` quantized by ``Params4bit.to`` (``_quantize``: ``functional.quantize_4bit``
with the config's quant type, double quantization and storage dtype), the module a ``Linear4bit`` with the
config's compute dtype; a bias stays as it was. The result is the model bitsandbytes would have loaded
from the same bf16 weights (tests/trainer/test_fp8.py compares the packed bytes).
"""

from __future__ import annotations

import torch


def skipped_modules(model, config) -> list[str]:
    """Module names (or name suffixes) that stay un-quantized: the output embeddings, the config's skip list
    and ``_keep_in_fp32_modules``."""
    skip = list(getattr(config, "llm_int8_skip_modules", None) or [])
    skip += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip += [name for name, module in model.named_modules() if output is not None and module is output]
    return skip


def _skipped(name: str, skip: list[str]) -> bool:
    dotted = f".{name}."
    return any(name == key or name.endswith(f".{key}") or f".{key}." in dotted for key in skip)


def linear_4bit(linear: torch.nn.Linear, config, device) -> torch.nn.Module:
    """``linear`` as a bitsandbytes ``Linear4bit`` on ``device``, quantized from its own weight."""
    # heavy: bitsandbytes
    import bitsandbytes as bnb

    settings = {
        "compress_statistics": bool(config.bnb_4bit_use_double_quant),
        "quant_type": config.bnb_4bit_quant_type,
        "quant_storage": config.bnb_4bit_quant_storage,
    }
    with torch.device("meta"):
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=config.bnb_4bit_compute_dtype,
            **settings,
        )
    layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, module=layer, **settings)
    if linear.bias is not None:
        layer.bias = torch.nn.Parameter(linear.bias.data, requires_grad=False)
    return layer.to(device)  # Params4bit.to quantizes (bitsandbytes nn/modules.py, Params4bit._quantize)


def quantize_linears_4bit(model, config) -> int:
    """Every ``nn.Linear`` of ``model`` that transformers' 4-bit loading would convert, converted in place
    (one layer at a time, each bf16 weight freed as its 4-bit one is made); returns how many."""
    skip = skipped_modules(model, config)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and not _skipped(name, skip)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, linear_4bit(module, config, module.weight.device))
    model.is_loaded_in_4bit = True  # PEFT reads it to wrap these layers in its lora.Linear4bit
    if targets and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return len(targets)
