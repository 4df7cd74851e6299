"""Fused linear cross-entropy == the reference F.cross_entropy on full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmft.trainer.fastpath.loss import IGNORE_INDEX, fused_linear_cross_entropy, shift_packed_labels


def _case(seed: int, tokens: int = 37, dim: int = 16, vocab: int = 53):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, tokens, dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64) * 0.3
    targets = torch.randint(0, vocab, (2, tokens), generator=gen)
    targets[torch.rand(2, tokens, generator=gen) < 0.4] = IGNORE_INDEX
    return hidden, weight, targets


def _reference(hidden, weight, targets, reduction):
    logits = hidden @ weight.t()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size", [5, 4096])
def test_loss_and_gradients_match_reference(reduction, chunk_size):
    hidden, weight, targets = _case(seed=chunk_size)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h_new, w_new = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = _reference(h_ref, w_ref, targets, reduction)
    new = fused_linear_cross_entropy(h_new, w_new, targets, reduction=reduction, chunk_size=chunk_size)
    (ref * 1.7).backward()
    (new * 1.7).backward()
    torch.testing.assert_close(new, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h_new.grad, h_ref.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w_new.grad, w_ref.grad, rtol=1e-10, atol=1e-10)


def test_ignored_positions_get_no_gradient_and_frozen_weight_none():
    hidden, weight, targets = _case(seed=3)
    hidden.requires_grad_()
    loss = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=7)
    loss.backward()
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and (~ignored).any()
    assert torch.count_nonzero(hidden.grad[ignored]) == 0
    assert torch.count_nonzero(hidden.grad[~ignored].abs().sum(-1)) == int((~ignored).sum())
    assert weight.grad is None


def test_precomputed_select_equals_device_select():
    hidden, weight, targets = _case(seed=4)
    select = torch.nonzero(targets.reshape(-1) != IGNORE_INDEX).reshape(-1)
    a = fused_linear_cross_entropy(hidden, weight, targets, select=select, chunk_size=8)
    b = fused_linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    assert torch.equal(a, b)


def test_bf16_close_to_fp32_reference():
    hidden, weight, targets = _case(seed=5, tokens=64, dim=32, vocab=300)
    ref = _reference(hidden, weight, targets, "mean")
    new = fused_linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=16)
    assert new.dtype == torch.float32
    # bf16 rounding of both factors moves a logit by at most eps_bf16·Σ|h·w| (2 x half an ulp each); the
    # mean of log-sum-exp minus the target logit moves by at most twice the largest logit change
    bound = 2 * torch.finfo(torch.bfloat16).eps * float((hidden.abs() @ weight.abs().T).max())
    assert abs(new.item() - ref.item()) <= bound


def test_shift_packed_labels_never_crosses_documents():
    labels = torch.tensor([[-100, 11, 12, -100, 21, 22, 23]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    targets = shift_packed_labels(labels, position_ids)
    # token 2 (last of doc 0) must not predict doc 1's first token; the row's last has no next.
    assert targets.tolist() == [[11, 12, -100, 21, 22, 23, -100]]


def test_bad_arguments_are_rejected():
    hidden, weight, targets = _case(seed=6)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    with pytest.raises(ValueError, match="disagree"):
        fused_linear_cross_entropy(hidden, weight, targets[:, :-1])
