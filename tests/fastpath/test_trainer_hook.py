"""trainer.loss.fused_token_nll_sum (trainer.fastpath's fused loss) is a drop-in for trainer.loss.token_nll_sum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from float_bounds import close, decoder_reduction_length

from llmft.trainer.data.shards import position_ids_for
from llmft.trainer.fastpath import apply_kernels
from llmft.trainer.loss import fused_token_nll_sum, packed_forward_kwargs


def _batch(vocab: int, lengths: list[int]) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=gen)
    positions = torch.from_numpy(position_ids_for(np.array(lengths))).long()[None]
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    targets[0, np.cumsum(lengths)[:-1] - 1] = -100  # never across documents
    targets[0, :3] = -100
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    return {
        "input_ids": ids,
        "position_ids": positions,
        "targets": targets,
        "cu_seqlens": cu,
        "max_seqlen": max(lengths),
    }


def test_fused_sum_equals_the_trainers_loss(small_qwen2):
    pytest.importorskip("llmft.trainer.loss")
    from llmft.trainer.loss import token_nll_sum

    batch = _batch(small_qwen2.config.vocab_size, [6, 10, 4])
    with torch.no_grad():
        reference = token_nll_sum(small_qwen2, batch)
        fused = fused_token_nll_sum(small_qwen2, batch)
    assert fused.dtype == torch.float32 and fused.ndim == 0
    tokens = int(batch["targets"].numel())  # fp32 rounding of the same sums in another order: tests/float_bounds.py
    torch.testing.assert_close(
        fused, reference, **close(reference, decoder_reduction_length(small_qwen2.config, tokens))
    )


def test_fused_sum_uses_the_loaders_supervised_positions(small_qwen2):
    """With ``supervised`` given, those positions (and only those) are the loss: a wrong index list
    changes it, so the value cannot come from a device-side search."""
    batch = _batch(small_qwen2.config.vocab_size, [6, 10, 4])
    supervised = torch.nonzero(batch["targets"].reshape(-1) != -100).reshape(-1)
    with torch.no_grad():
        searched = fused_token_nll_sum(small_qwen2, batch)
        given = fused_token_nll_sum(small_qwen2, {**batch, "supervised": supervised})
        fewer = fused_token_nll_sum(small_qwen2, {**batch, "supervised": supervised[:-4]})
    tokens = int(batch["targets"].numel())  # the same sums; at most their fp32 rounding (tests/float_bounds.py)
    torch.testing.assert_close(given, searched, **close(searched, decoder_reduction_length(small_qwen2.config, tokens)))
    assert fewer < searched


def test_forward_kwargs_bucket_the_longest_document():
    batch = _batch(50, [6, 200])
    kwargs = packed_forward_kwargs(batch)
    assert kwargs["max_length_q"] == 256 and kwargs["cu_seq_lens_q"].tolist() == [0, 6, 206]
    assert "cu_seq_lens_q" not in packed_forward_kwargs(
        {"position_ids": batch["position_ids"], "input_ids": batch["input_ids"]}
    )


def test_apply_kernels_on_a_plain_model_only_compiles(small_qwen2):
    report = apply_kernels(small_qwen2, compile_layers=False)
    assert report == {"fused_lora": 0, "lora_kept": {}, "grouped_lora": 0, "compiled_layers": 0}
