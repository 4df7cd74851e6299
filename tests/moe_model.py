"""A tiny random Qwen3-MoE (transformers' own class) for the MoE tests: 4 experts, top-2."""

from __future__ import annotations

from pathlib import Path


def tiny_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    values = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return Qwen3MoeConfig(**values)


def tiny_moe(dtype=None, seed: int = 0, **overrides):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(**overrides), dtype=dtype or torch.float32)
    return model.eval()


def save_tiny_moe_dir(path: Path, **overrides) -> Path:
    """Tokenizer of the project's tiny model + a random Qwen3-MoE sized to it, saved as safetensors."""
    from llmft.trainer.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    vocab = ((len(tokenizer) + 63) // 64) * 64
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny_moe(vocab_size=vocab, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **overrides)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path, safe_serialization=True)
    return path
