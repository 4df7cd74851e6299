"""QLoRA takes the fast path (llmft/trainer/fastpath/resolve.py) and the memory model counts its fused 4-bit
path (llmft/trainer/sizing/memory.py): less than LoRA at the same micro batch. No bitsandbytes needed."""

from __future__ import annotations

import pytest
import torch

from llmft.trainer.config_load import load_config
from llmft.trainer.fastpath.resolve import ModelInfo, resolve_fast_path
from llmft.trainer.flops import shape_from_config
from llmft.trainer.sizing import memory

GiB = memory.GiB
H100_FREE = 78.5 * GiB  # as tests/fastpath/test_memory.py
LARGEST_64_SAMPLES = 18447  # the benchmark's largest micro batch of 64 samples (test_memory.py's MEASURED)
MEAN_64_SAMPLES = 15656  # the H100 run's 64 samples per forward


def _setup(model: str, method: str, **kw) -> memory.Setup:
    from llmft.benchmarks.gpu.common import hf_config

    config = hf_config(model)
    return memory.Setup(
        shape=shape_from_config(config), method=method, tied_embeddings=config.tie_word_embeddings, **kw
    )


def test_qlora_on_cuda_takes_every_piece_and_cpu_none():
    cfg = load_config(None, ["model.name_or_path=m", "data=d", "method=qlora"])
    fast = resolve_fast_path(cfg, torch.device("cuda"), ModelInfo())
    assert fast.varlen and fast.fused_loss.on and fast.compile.on
    assert (fast.fused_lora.on, fast.fused_lora.why) == (True, "auto")
    assert (fast.grouped_lora.on, fast.grouped_lora.why) == (True, "auto")
    explicit = load_config(None, ["model.name_or_path=m", "data=d", "method=qlora", "kernels.fused_lora=true"])
    assert resolve_fast_path(explicit, torch.device("cuda"), ModelInfo()).fused_lora.why == "set true"
    cpu = resolve_fast_path(cfg, torch.device("cpu"), ModelInfo())
    assert not (cpu.fused_lora.on or cpu.compile.on or cpu.fused_loss.on) and cpu.attention == "sdpa"


@pytest.mark.parametrize("tokens", [MEAN_64_SAMPLES, LARGEST_64_SAMPLES])
@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_qlora_15b_at_64_samples_needs_less_than_lora(tokens, dropout):
    """Same activations as fused LoRA; NF4 weights instead of bf16 and no folded [W | sB] copies kept:
    the difference is exactly those two terms, less the dequantization transient (gate/up stacked)."""
    lora = memory.estimate(_setup("qwen2.5-1.5b", "lora", lora_dropout=dropout), tokens)
    qlora = memory.estimate(_setup("qwen2.5-1.5b", "qlora", lora_dropout=dropout), tokens)
    assert qlora.parts["activations"] == lora.parts["activations"]
    assert qlora.parts["folded_lora_weights"] == 0 < lora.parts["folded_lora_weights"]
    layers, total = memory.parameter_counts(_setup("qwen2.5-1.5b", "qlora").shape, tied=True)
    saved = (2 - memory.NF4_BYTES) * layers + lora.parts["folded_lora_weights"]
    assert lora.total - qlora.total == pytest.approx(saved, rel=1e-9)  # the loss chunk outweighs the dequant buffer
    assert qlora.total < lora.total - 3 * GiB
    assert qlora.total <= memory.budget_bytes(H100_FREE)  # fits one H100 without recomputation
    if (tokens, dropout) == (LARGEST_64_SAMPLES, 0.0):  # the GPU plan's prediction (llmft/benchmarks/gpu/session.sh)
        assert round(qlora.total / GiB, 1) == 42.6 and round(lora.total / GiB, 1) == 46.0


def test_dequantized_weights_are_a_transient_of_the_largest_group():
    """Fused: gate/up stacked, [2I, H] bf16, and its copy with the adapters folded in; PEFT's path: one
    weight at a time (bitsandbytes dequantizes per linear); LoRA dequantizes nothing."""
    shape = _setup("llama-3-8b", "qlora").shape
    h, i = shape.hidden, shape.intermediate
    assert memory.dequant_bytes(_setup("llama-3-8b", "qlora")) == 2 * 2 * h * 2 * i
    assert memory.dequant_bytes(_setup("llama-3-8b", "qlora", grouped_lora=False)) == 2 * 2 * h * i
    assert memory.dequant_bytes(_setup("llama-3-8b", "qlora", fused_lora=False)) == 2 * h * i
    assert memory.dequant_bytes(_setup("llama-3-8b", "lora")) == 0


def test_qlora_plan_puts_more_tokens_in_one_forward_than_lora():
    """The memory that 4-bit weights free goes to the micro batch (8B, 4096-token sequences)."""
    kw = dict(free_bytes=H100_FREE, max_length=4096, per_rank_sequences=32)
    qlora = memory.plan(_setup("llama-3-8b", "qlora", lora_dropout=0.05), **kw)
    lora = memory.plan(_setup("llama-3-8b", "lora", lora_dropout=0.05), **kw)
    assert qlora.checkpointed_layers == lora.checkpointed_layers == 0
    assert qlora.micro_sequences > lora.micro_sequences
    assert qlora.estimate_gib <= qlora.budget_gib


# (setup, largest micro batch in tokens, measured peak GiB): gpu-logs/2026-11-26-h100-qlora-fused (H100)
QLORA_MEASURED = [
    (_setup("qwen2.5-1.5b", "qlora"), LARGEST_64_SAMPLES, 42.87),
    (_setup("llama-3-8b", "qlora"), 5685, 33.77),
]


@pytest.mark.parametrize("setup, tokens, measured", QLORA_MEASURED, ids=["1.5b-64", "8b-16"])
def test_estimate_reproduces_the_measured_qlora_peaks(setup, tokens, measured):
    estimate = memory.estimate(setup, tokens).total / GiB
    assert -0.05 <= estimate / measured - 1 <= 0.03, estimate  # the error memory.py's doc states
    assert measured <= (estimate + memory.MARGIN_BYTES / GiB) / (1 - memory.MARGIN_FRACTION)  # plan() fits it
