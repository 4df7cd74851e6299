"""FLOP counter arithmetic on the benchmark's model shapes."""

from __future__ import annotations

import pytest

from llmft.trainer import flops

QWEN_1_5B = flops.ModelShape(
    n_layers=28, hidden=1536, n_heads=12, n_kv_heads=2, head_dim=128, intermediate=8960, vocab=151936
)


def test_matmul_params_of_qwen2_5_1_5b():
    per_layer = 1536 * 1536 * 2 + 1536 * 256 * 2 + 3 * 1536 * 8960
    assert flops.matmul_params(QWEN_1_5B) == 28 * per_layer + 151936 * 1536
    assert 1.54e9 < flops.matmul_params(QWEN_1_5B) < 1.55e9


def test_full_is_6n_and_lora_is_4n_plus_adapters():
    n = flops.matmul_params(QWEN_1_5B)
    assert flops.dense_flops_per_token(QWEN_1_5B, "full") == 6 * n
    adapters = 28 * 6 * 16 * ((1536 + 1536) + 2 * (1536 + 256) + (1536 + 1536) + 2 * (1536 + 8960) + (8960 + 1536))
    assert flops.lora_adapter_flops_per_token(QWEN_1_5B, 16) == adapters
    assert flops.dense_flops_per_token(QWEN_1_5B, "lora", lora_rank=16) == 4 * n + adapters
    only_q = flops.lora_adapter_flops_per_token(QWEN_1_5B, 8, ["q_proj"])
    assert only_q == 28 * 6 * 8 * (1536 + 1536)


def test_attention_is_causal_per_document():
    shape = flops.ModelShape(n_layers=2, hidden=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate=16, vocab=10)
    # one document of 3 tokens: 3*4 = 12 "pairs x 2"; forward 2*12*4*2*2 = 384; x3 for backward.
    assert flops.attention_flops(shape, [3]) == 3 * 2 * 12 * 4 * 2 * 2
    # packing two documents costs the sum of each, not the square of the total.
    assert flops.attention_flops(shape, [3, 3]) == 2 * flops.attention_flops(shape, [3])
    assert flops.attention_flops(shape, [6]) > flops.attention_flops(shape, [3, 3])


def test_step_and_per_token_flops_and_mfu():
    """The step's count written out from the shapes (not from the functions it is made of): LoRA r16 all-linear
    on 450 tokens in three documents."""
    docs = [100, 300, 50]
    n = 28 * (1536 * 1536 * 2 + 1536 * 256 * 2 + 3 * 1536 * 8960) + 151936 * 1536
    adapters = 28 * 6 * 16 * ((1536 + 1536) + 2 * (1536 + 256) + (1536 + 1536) + 2 * (1536 + 8960) + (8960 + 1536))
    pairs = 100 * 101 + 300 * 301 + 50 * 51  # 2 x L(L+1)/2 causal query-key pairs per document
    attention = 3 * 2 * pairs * 128 * 12 * 28  # forward 2 FLOPs x pairs x head_dim x heads x layers; backward 2x
    total = flops.step_flops(QWEN_1_5B, "lora", docs)
    assert total == (4 * n + adapters) * 450 + attention
    assert flops.step_flops(QWEN_1_5B, "full", docs) == 6 * n * 450 + attention
    assert flops.mfu(989.4e12, 2.0, flops.peak_flops("NVIDIA H100 80GB HBM3")) == pytest.approx(0.5)
    assert flops.peak_flops("NVIDIA GH200 480GB") == flops.PEAK_BF16_FLOPS["GH200"]
    assert flops.peak_flops("cpu") is None and flops.mfu(1.0, 1.0, None) is None


def test_shape_from_hf_config_dict_and_errors():
    shape = flops.shape_from_config(
        {
            "num_hidden_layers": 28,
            "hidden_size": 1536,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "intermediate_size": 8960,
            "vocab_size": 151936,
        }
    )
    assert shape == QWEN_1_5B
    with pytest.raises(ValueError, match="unknown LoRA target"):
        flops.lora_adapter_flops_per_token(QWEN_1_5B, 16, ["lm_head"])
    with pytest.raises(ValueError, match="unknown method"):
        flops.dense_flops_per_token(QWEN_1_5B, "prefix")
