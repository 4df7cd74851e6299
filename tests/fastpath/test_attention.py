"""Per-document attention: a packed row equals each document run on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from float_bounds import close, decoder_reduction_length

from llmft.trainer.data.shards import position_ids_for
from llmft.trainer.fastpath.attention import (
    ATTENTION_NAME,
    cu_seqlens_from_position_ids,
    packed_attention_kwargs,
)
from llmft.trainer.loss import bucket_max_length

DOC_LENGTHS = [5, 11, 1, 8]


def _docs(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in DOC_LENGTHS]


def _separate_hidden(model, docs):
    outs = []
    for doc in docs:
        out = model.model(input_ids=doc[None], use_cache=False).last_hidden_state[0]
        outs.append(out)
    return torch.cat(outs)


def test_packed_forward_equals_separate_documents(small_qwen2):
    assert small_qwen2.config._attn_implementation == ATTENTION_NAME
    docs = _docs(small_qwen2.config.vocab_size)
    packed = torch.cat(docs)[None]
    positions = torch.from_numpy(position_ids_for(np.array(DOC_LENGTHS))).long()[None]
    kwargs = packed_attention_kwargs(DOC_LENGTHS)
    with torch.no_grad():
        reference = _separate_hidden(small_qwen2, docs)
        from_kwargs = small_qwen2.model(input_ids=packed, position_ids=positions, use_cache=False, **kwargs)
        from_positions = small_qwen2.model(input_ids=packed, position_ids=positions, use_cache=False)
    tol = close(reference, decoder_reduction_length(small_qwen2.config, packed.numel()))  # tests/float_bounds.py
    torch.testing.assert_close(from_kwargs.last_hidden_state[0], reference, **tol)
    torch.testing.assert_close(from_positions.last_hidden_state[0], reference, **tol)


def test_documents_do_not_see_each_other(small_qwen2):
    """Changing document 0 leaves every other document's hidden states unchanged."""
    docs = _docs(small_qwen2.config.vocab_size, seed=1)
    positions = torch.from_numpy(position_ids_for(np.array(DOC_LENGTHS))).long()[None]
    kwargs = packed_attention_kwargs(DOC_LENGTHS)
    changed = [(docs[0] + 1) % small_qwen2.config.vocab_size, *docs[1:]]
    with torch.no_grad():
        a = small_qwen2.model(input_ids=torch.cat(docs)[None], position_ids=positions, use_cache=False, **kwargs)
        b = small_qwen2.model(input_ids=torch.cat(changed)[None], position_ids=positions, use_cache=False, **kwargs)
    first = DOC_LENGTHS[0]
    assert not torch.allclose(a.last_hidden_state[0, :first], b.last_hidden_state[0, :first])
    torch.testing.assert_close(a.last_hidden_state[0, first:], b.last_hidden_state[0, first:], rtol=0, atol=0)


def test_packed_kwargs_and_boundaries():
    kwargs = packed_attention_kwargs([3, 4, 200])
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 7, 207]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == 256 == kwargs["max_length_k"]
    assert bucket_max_length(1) == 128 and bucket_max_length(129) == 256 and bucket_max_length(256) == 256
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    assert cu_seqlens_from_position_ids(positions).tolist() == [0, 3, 7, 8]
    with pytest.raises(ValueError, match="positive"):
        packed_attention_kwargs([3, 0])


def test_dropout_and_cache_are_refused(small_qwen2):
    from llmft.trainer.fastpath.attention import varlen_attention_forward

    q = torch.randn(1, 4, 6, 16)
    kv = torch.randn(1, 2, 6, 16)
    with pytest.raises(ValueError, match="dropout"):
        varlen_attention_forward(None, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="padding"):
        varlen_attention_forward(None, q, kv, kv, torch.tensor([[1, 1, 1, 1, 0, 0]]))


def test_batch_of_rows_with_broadcast_positions(small_qwen2):
    """Two unpacked rows (position_ids defaulted to one broadcast row) equal two separate forwards."""
    ids = torch.randint(0, small_qwen2.config.vocab_size, (2, 7))
    with torch.no_grad():
        batched = small_qwen2.model(input_ids=ids, use_cache=False).last_hidden_state
        rows = [small_qwen2.model(input_ids=ids[i : i + 1], use_cache=False).last_hidden_state[0] for i in range(2)]
    rows = torch.stack(rows)  # fp32 rounding of the same sums in another order: tests/float_bounds.py
    torch.testing.assert_close(batched, rows, **close(rows, decoder_reduction_length(small_qwen2.config, ids.numel())))


def test_the_gqa_mode_is_an_argument_of_register():
    """How GQA reaches the varlen kernel is chosen when registering (data), not by a module global."""
    from transformers import AttentionInterface

    from llmft.trainer.fastpath import attention

    with pytest.raises(ValueError, match="GQA mode 'sideways'"):
        attention.register("sideways")
    try:
        attention.register("native")
        registered = AttentionInterface._global_mapping[ATTENTION_NAME]
        assert registered.keywords == {"gqa_mode": "native"}  # a partial of varlen_attention_forward
    finally:
        attention.register()
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is attention.varlen_attention_forward
    assert not hasattr(attention, "GQA_MODE")
