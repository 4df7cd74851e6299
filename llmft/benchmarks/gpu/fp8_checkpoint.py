"""The benchmark's Qwen3-30B-A3B checkpoint in FP8, the form the seeds train from (Qwen/Qwen3-30B-A3B-FP8).

In bf16 the random-init checkpoint is 61 GB, which does not fit a one-GPU device machine's 64 GB disk beside
the image; in transformers' fine-grained FP8 (float8_e4m3fn weights, one float32 ``weight_scale_inv`` per
128 x 128 block, llmft/trainer/fp8.py ``quantize_blockwise``) it is about 31 GB. What is quantized is what
the Qwen3 FP8 releases quantize: the attention projections and every expert's gate/up/down; embeddings,
``lm_head``, norms and routers stay bf16. The trainer loads it as it loads the seeds' base: LoRA dequantized
on load, QLoRA dequantized onto the GPU and stored in 4 bits (llmft/trainer/fp8.py).

Written tensor by tensor, one safetensors shard per decoder layer, with the random init of
``common.build_model`` (normal, std ``initializer_range``; norms 1), seeded per tensor: nothing close to the
whole model is ever in memory, on the GPU or the host.

python -m llmft.benchmarks.gpu.fp8_checkpoint --model qwen3-30b-a3b --out /tmp/llmft-project/models
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

from llmft.benchmarks.gpu import common
from llmft.trainer.tiny_model import build_tokenizer

BLOCK = (128, 128)
FP8_MODELS = ("qwen3-30b-a3b",)
"""Shapes whose benchmark checkpoint is written in FP8 (the others stay bf16: arm_project.write_model_dir)."""


def layer_tensors(config, i: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """``{checkpoint name: (shape, FP8?)}`` of decoder layer ``i`` in the checkpoint layout (experts one by one)."""
    h, head = config.hidden_size, config.head_dim
    q, kv, inner = config.num_attention_heads * head, config.num_key_value_heads * head, config.moe_intermediate_size
    p = f"model.layers.{i}."
    out = {
        p + "input_layernorm.weight": ((h,), False),
        p + "post_attention_layernorm.weight": ((h,), False),
        p + "self_attn.q_norm.weight": ((head,), False),
        p + "self_attn.k_norm.weight": ((head,), False),
        p + "self_attn.q_proj.weight": ((q, h), True),
        p + "self_attn.k_proj.weight": ((kv, h), True),
        p + "self_attn.v_proj.weight": ((kv, h), True),
        p + "self_attn.o_proj.weight": ((h, q), True),
        p + "mlp.gate.weight": ((config.num_experts, h), False),
    }
    for e in range(config.num_experts):
        for name, shape in (("gate_proj", (inner, h)), ("up_proj", (inner, h)), ("down_proj", (h, inner))):
            out[f"{p}mlp.experts.{e}.{name}.weight"] = (shape, True)
    return out


def outer_tensors(config) -> dict[str, tuple[tuple[int, ...], bool]]:
    v, h = config.vocab_size, config.hidden_size
    return {
        "model.embed_tokens.weight": ((v, h), False),
        "lm_head.weight": ((v, h), False),
        "model.norm.weight": ((h,), False),
    }


def make_tensors(spec: dict, std: float, seed: int, device) -> dict:
    """Random init of ``spec`` (1-D: ones), each tensor seeded by its name; FP8 ones quantized blockwise."""
    # heavy: torch
    import torch

    # heavy: torch
    from llmft.trainer.fp8 import quantize_blockwise

    out = {}
    for name, (shape, fp8) in spec.items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        weight = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(0.0, std, generator=gen)
        if fp8:
            q, scale = quantize_blockwise(weight, BLOCK)
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q.cpu(), scale.cpu()
        else:
            out[name] = weight.cpu()
    return out


def write_fp8_model_dir(model: str, root: Path, seed: int = 0, device: str = "cuda", config=None) -> Path:
    """``root/model``: config, tokenizer and FP8 safetensors shards with their index; written once
    (a ``.partial`` folder renamed at the end, so a cut write is never taken for a checkpoint). ``config``:
    a transformers Qwen3-MoE config instead of the named shape's (tests)."""
    # heavy: safetensors
    from safetensors.torch import save_file

    out = root / model
    if (out / "config.json").is_file():
        return out
    config = config or common.hf_config(model)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    std = float(config.initializer_range)
    shards = [outer_tensors(config)] + [layer_tensors(config, i) for i in range(config.num_hidden_layers)]
    weight_map, total = {}, 0
    for index, spec in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = make_tensors(spec, std, seed, device)
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1) + "\n")
    data = config.to_dict()
    data["dtype"] = "bfloat16"
    data["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": ["lm_head"],
    }
    (tmp / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    build_tokenizer().save_pretrained(tmp)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(common.MODEL_SHAPES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    print(write_fp8_model_dir(a.model, a.out, device=a.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
