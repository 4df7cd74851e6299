"""LoRA dropout inside the fused (and grouped) LoRA path has PEFT's semantics, exactly.

Both paths draw their Bernoulli masks with the kernel nn.Dropout runs (native_dropout), one mask
per adapted linear in the order the layer calls them, so from the same generator state they drop
the same elements: float64 outputs and every gradient agree to rounding.
"""

from __future__ import annotations

import pytest
import torch
from llmft.trainer.fastpath.lora import count_fused, fuse_lora_linears, lora_linear
from llmft.trainer.fastpath.lora_groups import count_grouped, group_lora_projections, grouped_lora_linear
from peft import LoraConfig, get_peft_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = dict(rtol=1e-10, atol=1e-12)  # float64: a different mask or a missing 1/(1-p) moves values by O(1)


def _peft64(model, dropout: float):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(model.double(), config).train()


def _run(model, input_ids, seed: int):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=input_ids, use_cache=False).logits
    (out**2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("grouped", [False, True])
def test_fused_lora_with_dropout_equals_peft_in_float64(small_qwen2, grouped):
    model = _peft64(small_qwen2, dropout=0.3)
    input_ids = torch.randint(0, small_qwen2.config.vocab_size, (1, 12))
    ref_out, ref_grads = _run(model, input_ids, seed=7)
    other_out, _ = _run(model, input_ids, seed=8)
    assert not torch.allclose(other_out, ref_out)  # dropout really is on: another seed, other masks

    assert fuse_lora_linears(model) == {} and count_fused(model) == 2 * len(TARGETS)
    if grouped:
        assert group_lora_projections(model) == {} and count_grouped(model) == 4
    out, grads = _run(model, input_ids, seed=7)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert grads.keys() == ref_grads.keys() and len(grads) == 4 * len(TARGETS)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **TOL, msg=name)


def test_eval_mode_turns_dropout_off_on_the_fused_path(small_qwen2):
    model = _peft64(small_qwen2, dropout=0.3)
    input_ids = torch.randint(0, small_qwen2.config.vocab_size, (1, 9))
    fuse_lora_linears(model)
    group_lora_projections(model)
    model.eval()
    with torch.no_grad():
        torch.manual_seed(1)
        first = model(input_ids=input_ids, use_cache=False).logits
        torch.manual_seed(2)
        second = model(input_ids=input_ids, use_cache=False).logits
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("mode", ["epilogue", "concat"])
def test_fused_forms_with_dropout_match_the_formula(mode):
    """y = x W^T + b + s ((x * m / (1 - p)) A^T) B^T with the mask native_dropout draws; dx, dW, db, dA, dB."""
    gen = torch.Generator().manual_seed(3)
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=gen)  # noqa: E731
    p, s = 0.25, 1.5
    x, w, bias, a, b, g = rnd(2, 5, 12), rnd(20, 12), rnd(20), rnd(4, 12), rnd(20, 4), rnd(2, 5, 20)
    torch.manual_seed(11)
    _, mask = torch.native_dropout(x.reshape(-1, 12), p, True)
    assert 0 < int(mask.sum()) < mask.numel()
    ref_in = _leaves(x, w, bias, a, b)
    xr = ref_in[0]
    dropped = (xr.reshape(-1, 12) * mask / (1 - p)).view(2, 5, 12)
    ref = xr @ ref_in[1].t() + ref_in[2] + s * (dropped @ ref_in[3].t()) @ ref_in[4].t()
    ref.backward(g)
    mine = _leaves(x, w, bias, a, b)
    torch.manual_seed(11)
    out = lora_linear(*mine, s, mode=mode, dropout=p)
    out.backward(g)
    torch.testing.assert_close(out, ref, **TOL)
    for leaf, ref_leaf in zip(mine, ref_in, strict=True):
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, **TOL)


def test_grouped_function_draws_one_mask_per_sibling():
    """Siblings with different dropouts (one of them 0) each see their own mask, in order."""
    gen = torch.Generator().manual_seed(4)
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=gen)  # noqa: E731
    d_in, outs, ranks, scalings, drops = 10, (8, 4, 4), (3, 2, 2), (2.0, 0.5, 1.0), (0.2, 0.0, 0.4)
    x = rnd(1, 6, d_in)
    ws, a_s = [rnd(o, d_in) for o in outs], [rnd(r, d_in) for r in ranks]
    b_s = [rnd(o, r) for o, r in zip(outs, ranks, strict=True)]
    g = rnd(1, 6, sum(outs))
    ref_in = _leaves(x, *ws, *a_s, *b_s)
    xr, wr, ar, br = ref_in[0], ref_in[1:4], ref_in[4:7], ref_in[7:10]
    torch.manual_seed(5)
    parts = []
    for w, a, b, s, p in zip(wr, ar, br, scalings, drops, strict=True):
        xd = torch.nn.functional.dropout(xr, p, training=True) if p else xr
        parts.append(xr @ w.t() + s * (xd @ a.t()) @ b.t())
    ref = torch.cat(parts, dim=-1)
    ref.backward(g)
    mine = _leaves(x, *ws, *a_s, *b_s)
    torch.manual_seed(5)
    out = grouped_lora_linear(mine[0], mine[1:4], [None] * 3, mine[4:7], mine[7:10], scalings, drops)
    out.backward(g)
    torch.testing.assert_close(out, ref, **TOL)
    for leaf, ref_leaf in zip(mine, ref_in, strict=True):
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, **TOL)


@pytest.mark.slow
def test_compiled_layer_traces_the_dropout_path_without_graph_breaks(small_qwen2):
    """fullgraph=True over a decoder layer whose fused, grouped LoRA linears draw dropout masks."""
    small_qwen2.set_attn_implementation("sdpa")  # no per-document boundaries to find on this plain row
    model = get_peft_model(
        small_qwen2,
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=TARGETS, init_lora_weights=False),
    ).train()
    fuse_lora_linears(model)
    group_lora_projections(model)
    torch._dynamo.reset()
    for layer in (m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")):
        layer.compile(fullgraph=True, backend="aot_eager")
    input_ids = torch.randint(0, small_qwen2.config.vocab_size, (1, 10))
    out = model(input_ids=input_ids, use_cache=False).logits
    (out.float() ** 2).mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert grads and all(gr is not None and torch.isfinite(gr).all() for gr in grads)
    torch._dynamo.reset()
