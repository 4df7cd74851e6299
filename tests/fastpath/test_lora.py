"""The fused LoRA linear computes what PEFT's lora.Linear computes, forward and backward."""

from __future__ import annotations

import pytest
import torch
from float_bounds import close, decoder_reduction_length
from peft import LoraConfig, get_peft_model

from llmft.trainer.fastpath.lora import count_fused, fuse_lora_linears
from llmft.trainer.fastpath.lora_groups import count_grouped, group_lora_projections

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(model, dropout=0.0):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(model, config)


def _loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, use_cache=False).logits
    loss = (out.float() ** 2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads


def test_fused_lora_matches_peft(small_qwen2):
    model = _peft(small_qwen2)
    input_ids = torch.randint(0, small_qwen2.config.vocab_size, (2, 9))
    ref_out, ref_grads = _loss_and_grads(model, input_ids)
    assert fuse_lora_linears(model) == {}
    assert count_fused(model) == 2 * len(TARGETS)
    new_out, new_grads = _loss_and_grads(model, input_ids)
    n = decoder_reduction_length(small_qwen2.config, input_ids.numel())  # fp32 rounding: tests/float_bounds.py
    torch.testing.assert_close(new_out, ref_out, **close(ref_out, n))
    assert ref_grads.keys() == new_grads.keys() and len(ref_grads) == 4 * len(TARGETS)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(new_grads[name], grad, **close(grad, n), msg=name)
    # Frozen base weights get no gradient either way.
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_fused_lora_is_idempotent_and_keeps_state_dict(small_qwen2):
    model = _peft(small_qwen2)
    keys = list(model.state_dict())
    fuse_lora_linears(model)
    fuse_lora_linears(model)
    assert list(model.state_dict()) == keys
    assert count_fused(model) == 2 * len(TARGETS)


def test_dropout_no_longer_keeps_peft_forward(small_qwen2):
    """LoRA dropout runs inside the fused path (test_lora_dropout.py proves it exact against PEFT)."""
    model = _peft(small_qwen2, dropout=0.1)
    assert fuse_lora_linears(model) == {}
    assert count_fused(model) == 2 * len(TARGETS)


def test_an_unknown_dropout_module_keeps_peft_forward(small_qwen2):
    """The module whose dropout the fused path cannot run stays PEFT's: in training mode, with the same random
    stream, the partly fused model computes what PEFT computes (AlphaDropout's mask included); the others fuse."""
    model = _peft(small_qwen2)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    q_proj.lora_dropout["default"] = torch.nn.AlphaDropout(0.5)
    model.train()
    input_ids = torch.randint(0, small_qwen2.config.vocab_size, (2, 9))
    torch.manual_seed(7)
    ref_out, ref_grads = _loss_and_grads(model, input_ids)
    skipped = fuse_lora_linears(model)
    assert list(skipped) == ["base_model.model.model.layers.0.self_attn.q_proj"]
    assert "AlphaDropout" in skipped["base_model.model.model.layers.0.self_attn.q_proj"]
    assert count_fused(model) == 2 * len(TARGETS) - 1
    torch.manual_seed(7)
    new_out, new_grads = _loss_and_grads(model, input_ids)
    n = decoder_reduction_length(small_qwen2.config, input_ids.numel())  # fp32 rounding: tests/float_bounds.py
    torch.testing.assert_close(new_out, ref_out, **close(ref_out, n))
    for name, grad in ref_grads.items():
        torch.testing.assert_close(new_grads[name], grad, **close(grad, n), msg=name)
    torch.manual_seed(8)  # another mask: the dropout really runs (the comparison above is not of a no-op)
    assert not torch.allclose(_loss_and_grads(model, input_ids)[0], new_out)


@pytest.mark.parametrize("grouped", [False, True])
def test_disabled_adapter_falls_back(small_qwen2, grouped):
    """Fused (and with q/k/v, gate/up grouped): a disabled adapter gives the base model exactly."""
    model = _peft(small_qwen2)
    input_ids = torch.randint(0, small_qwen2.config.vocab_size, (1, 7))
    with torch.no_grad(), model.disable_adapter():
        base_before = model(input_ids=input_ids, use_cache=False).logits
    fuse_lora_linears(model)
    if grouped:
        assert group_lora_projections(model) == {} and count_grouped(model) > 0
    with torch.no_grad(), model.disable_adapter():
        base_after = model(input_ids=input_ids, use_cache=False).logits
    with torch.no_grad():
        adapted = model(input_ids=input_ids, use_cache=False).logits
    torch.testing.assert_close(base_after, base_before, rtol=0, atol=0)
    assert not torch.allclose(base_after, adapted)


def test_both_fused_forms_match_reference_in_float64():
    from llmft.trainer.fastpath.lora import lora_linear

    gen = torch.Generator().manual_seed(3)
    for d_in, d_out in ((12, 40), (40, 12)):
        x = torch.randn(2, 5, d_in, dtype=torch.float64, generator=gen)
        w = torch.randn(d_out, d_in, dtype=torch.float64, generator=gen)
        bias = torch.randn(d_out, dtype=torch.float64, generator=gen)
        a = torch.randn(4, d_in, dtype=torch.float64, generator=gen)
        b = torch.randn(d_out, 4, dtype=torch.float64, generator=gen)
        g = torch.randn(2, 5, d_out, dtype=torch.float64, generator=gen)
        leaves = [t.clone().requires_grad_() for t in (x, w, bias, a, b)]
        ref = leaves[0] @ leaves[1].t() + leaves[2] + 2.5 * (leaves[0] @ leaves[3].t()) @ leaves[4].t()
        ref.backward(g)
        for mode in ("epilogue", "concat"):
            mine = [t.clone().requires_grad_() for t in (x, w, bias, a, b)]
            out = lora_linear(*mine, 2.5, mode=mode)
            out.backward(g)
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
            for leaf, ref_leaf in zip(mine, leaves, strict=True):
                torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-12, atol=1e-12)


def test_the_fused_form_is_an_argument_each_module_keeps(small_qwen2, monkeypatch):
    """The form (epilogue / concat / auto) is data passed to fuse_lora_linears, kept per module and
    handed to lora_linear on every call: no module global a caller sets from outside."""
    from llmft.trainer.fastpath import lora

    model = _peft(small_qwen2)
    with pytest.raises(ValueError, match="LoRA mode 'sideways'"):
        fuse_lora_linears(model, "sideways")
    assert fuse_lora_linears(model, "concat") == {}
    seen = []
    real = lora.lora_linear
    monkeypatch.setattr(lora, "lora_linear", lambda *a, **k: seen.append(k["mode"]) or real(*a, **k))
    model(input_ids=torch.randint(0, small_qwen2.config.vocab_size, (1, 5)), use_cache=False)
    assert seen and set(seen) == {"concat"}
    assert not hasattr(lora, "LORA_MODE")
