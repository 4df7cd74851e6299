"""Best-fit packing, and the proof that packed documents never see each other:
on the tiny model in fp32, a packed row's per-token losses and hidden states
equal those of each document run on its own."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from float_bounds import close, decoder_reduction_length, rounding_bound
from transformers import AutoModelForCausalLM

from llmft.trainer.data.packing import best_fit_pack
from llmft.trainer.data.shards import IGNORE_INDEX, open_split


def _reference_best_fit(lengths, capacity):
    """Straightforward O(n * bins) best-fit decreasing, to check the fast version against."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins, free = [], []
    for doc in order:
        fits = [(free[b], b) for b in range(len(bins)) if free[b] >= lengths[doc]]
        if fits:
            _, b = min(fits)
        else:
            bins.append([])
            free.append(capacity)
            b = len(bins) - 1
        bins[b].append(doc)
        free[b] -= lengths[doc]
    return bins


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_fit_matches_reference_and_respects_capacity(seed):
    rng = random.Random(seed)
    lengths = [min(512, max(1, int(rng.lognormvariate(4.5, 0.8)))) for _ in range(2000)]
    packed = best_fit_pack(np.array(lengths), 512)
    assert packed == _reference_best_fit(lengths, 512)
    assert sorted(d for seq in packed for d in seq) == list(range(len(lengths)))
    assert all(sum(lengths[d] for d in seq) <= 512 for seq in packed)
    lower_bound = -(-sum(lengths) // 512)
    assert len(packed) <= lower_bound * 1.03


def test_best_fit_edge_cases():
    assert best_fit_pack(np.array([], dtype=np.int64), 8) == []
    assert best_fit_pack(np.array([8, 8]), 8) == [[0], [1]]
    assert best_fit_pack(np.array([5, 3, 4, 4]), 8) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        best_fit_pack(np.array([9]), 8)


def test_packed_shards_hold_every_document_once(tokenized_sample):
    for split in ("train", "val"):
        packed, plain = open_split(tokenized_sample["packed"], split), open_split(tokenized_sample["unpacked"], split)

        def docs(s):
            off = np.asarray(s.doc_offsets)
            return sorted(
                (tuple(s.input_ids[a:b].tolist()), tuple(s.labels[a:b].tolist()))
                for a, b in zip(off[:-1], off[1:], strict=True)
            )

        assert docs(packed) == docs(plain)
        assert packed.sequence_lengths(np.arange(len(packed))).max() <= 256
        assert len(packed) < len(plain)
    stats = tokenized_sample["packed_manifest"]["splits"]["train"]
    assert stats["packing_efficiency"] > 0.9
    assert stats["packing_efficiency"] > tokenized_sample["unpacked_manifest"]["splits"]["train"]["packing_efficiency"]


def _shifted_targets(labels: np.ndarray, doc_lengths: np.ndarray) -> torch.Tensor:
    """targets[t] = labels[t+1] within a document; -100 at each document's last token."""
    targets = np.full(len(labels), IGNORE_INDEX, np.int64)
    targets[:-1] = labels[1:]
    targets[np.cumsum(doc_lengths) - 1] = IGNORE_INDEX
    return torch.from_numpy(targets)


def _token_losses(logits, targets):
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_per_document_losses(tokenized_sample, tiny_model_dir, attn):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn, dtype=torch.float32).eval()
    split = open_split(tokenized_sample["packed"], "train")
    multi = [i for i in range(len(split)) if len(split[i].doc_lengths) >= 3][:3]
    assert multi, "the sample should pack several documents per sequence"
    for index in multi:
        seq = split[index]
        ids = torch.from_numpy(seq.input_ids.astype(np.int64))[None]
        with torch.no_grad():
            packed = model(
                input_ids=ids,
                position_ids=torch.from_numpy(seq.position_ids.astype(np.int64))[None],
                use_cache=False,
                output_hidden_states=True,
            )
            packed_losses = _token_losses(packed.logits[0], _shifted_targets(seq.labels, seq.doc_lengths))
            leaky = model(input_ids=ids, use_cache=False).logits[0]  # negative control: one causal row
            starts = np.concatenate([[0], np.cumsum(seq.doc_lengths)])
            alone_losses, alone_hidden = [], []
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                out = model(input_ids=ids[:, a:b], use_cache=False, output_hidden_states=True)
                alone_losses.append(_token_losses(out.logits[0], _shifted_targets(seq.labels[a:b], np.array([b - a]))))
                alone_hidden.append(out.hidden_states[-1][0])
        alone = torch.cat(alone_losses)
        mask = _shifted_targets(seq.labels, seq.doc_lengths) != IGNORE_INDEX
        # fp32 rounding of the same sums in another order (tests/float_bounds.py)
        n = decoder_reduction_length(model.config, ids.numel())
        torch.testing.assert_close(packed_losses, alone, **close(alone, n))
        assert packed_losses[mask].mean().item() == pytest.approx(alone[mask].mean().item(), rel=rounding_bound(n))
        hidden_alone = torch.cat(alone_hidden)
        torch.testing.assert_close(packed.hidden_states[-1][0], hidden_alone, **close(hidden_alone, n))
        later = slice(int(starts[1]), None)
        assert (leaky[later] - packed.logits[0][later]).abs().max() > 1e-2, (
            "control: cross-document attention must differ"
        )
