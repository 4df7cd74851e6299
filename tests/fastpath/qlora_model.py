"""A small random Qwen2 whose decoder linears are real bitsandbytes 4-bit layers, for the QLoRA tests.

bitsandbytes 0.50 runs 4-bit NF4/FP4 quantization, dequantization and ``matmul_4bit`` (forward and
backward) on its CPU backend, so the tests use the library itself: ``bnb.nn.Linear4bit`` layers
quantized here from the model's own weights (what transformers' ``BitsAndBytesConfig(load_in_4bit)``
builds on a GPU), wrapped by PEFT's ``lora.Linear4bit`` (peft/tuners/lora/bnb.py) because the model
says ``is_loaded_in_4bit`` (peft/tuners/lora/model.py reads it for its 4-bit dispatch).
"""

from __future__ import annotations

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def linear_4bit(linear: torch.nn.Linear, compute_dtype, *, quant_type="nf4", double_quant=True, storage=torch.uint8):
    """``linear`` as a bitsandbytes Linear4bit (CPU), quantized from its weight; the bias stays as it is."""
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=double_quant,
        quant_type=quant_type,
        quant_storage=storage,
    )
    layer.weight = bnb.nn.Params4bit(
        linear.weight.data.clone(),
        requires_grad=False,
        compress_statistics=double_quant,
        quant_type=quant_type,
        quant_storage=storage,
        module=layer,
    )
    if linear.bias is not None:
        layer.bias = torch.nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer.to("cpu")  # quantizes (Params4bit.to -> _quantize)


def to_4bit(model, compute_dtype=None, skip: tuple[str, ...] = (), **kwargs):
    """Every decoder linear of ``model`` (not lm_head, not the names in ``skip``) as a 4-bit layer, in place."""
    compute_dtype = compute_dtype or next(model.parameters()).dtype
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear) and name not in skip:
                    setattr(parent, name, linear_4bit(child, compute_dtype, **kwargs))
    model.is_loaded_in_4bit = True
    return model


def dequantized(layer, dtype=torch.float32) -> torch.Tensor:
    """bitsandbytes' own dequantization of a Linear4bit's weight (functional.dequantize_4bit) in ``dtype``."""
    import copy

    import bitsandbytes as bnb

    state = copy.copy(layer.weight.quant_state)
    state.dtype = dtype
    return bnb.functional.dequantize_4bit(layer.weight.data, state)
