"""compile_decoder_layers compiles in place and keeps the model's function."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from float_bounds import close, decoder_reduction_length

from llmft.trainer.data.shards import position_ids_for
from llmft.trainer.fastpath.attention import packed_attention_kwargs
from llmft.trainer.fastpath.compile import compile_decoder_layers, decoder_layers
from llmft.trainer.fastpath.loss import fused_causal_lm_loss, shift_packed_labels

pytestmark = pytest.mark.slow  # torch.compile of decoder layers


def test_compiled_layers_give_the_same_fused_loss(small_qwen2):
    lengths = [4, 9, 3]
    ids = torch.randint(0, small_qwen2.config.vocab_size, (1, sum(lengths)))
    positions = torch.from_numpy(position_ids_for(np.array(lengths))).long()[None]
    targets = shift_packed_labels(ids.clone(), positions)
    kwargs = dict(position_ids=positions, **packed_attention_kwargs(lengths))
    with torch.no_grad():
        before = fused_causal_lm_loss(small_qwen2, ids, targets, reduction="mean", **kwargs)
        reference = torch.nn.functional.cross_entropy(
            small_qwen2(input_ids=ids, use_cache=False, **kwargs).logits[0], targets[0], ignore_index=-100
        )
    tol = close(reference, decoder_reduction_length(small_qwen2.config, ids.numel()))  # tests/float_bounds.py
    torch.testing.assert_close(before, reference, **tol)
    assert compile_decoder_layers(small_qwen2, backend="eager") == len(decoder_layers(small_qwen2)) == 2
    with torch.no_grad():
        after = fused_causal_lm_loss(small_qwen2, ids, targets, reduction="mean", **kwargs)
    torch.testing.assert_close(after, before, **tol)


def test_compile_cache_dir_points_inductor_at_a_persistent_folder(small_qwen2, tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/ambient")
    cache = tmp_path / "pvc" / "compile-cache"
    compile_decoder_layers(small_qwen2, backend="eager", cache_dir=str(cache))
    assert cache.is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(cache)
