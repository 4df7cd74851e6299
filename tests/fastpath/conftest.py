"""Fixtures for the fast-path tests: a small random Qwen2 in fp32 on CPU."""

from __future__ import annotations

import pytest


@pytest.fixture()
def small_qwen2():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llmft.trainer.fastpath.attention import register

    register()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attn_implementation="llmft_varlen",
    )
    model = Qwen2ForCausalLM(config).float().eval()
    return model
