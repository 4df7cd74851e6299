"""Grouped sibling projections (q/k/v, gate/up) compute what PEFT's separate LoRA linears compute."""

from __future__ import annotations

import pytest
import torch
from float_bounds import close, decoder_reduction_length
from peft import LoraConfig, get_peft_model

import llmft.trainer.fastpath.lora as lora_module
from llmft.trainer.fastpath.lora import fuse_lora_linears, take_given_output
from llmft.trainer.fastpath.lora_groups import count_grouped, group_lora_projections, grouped_lora_linear

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(model, targets=TARGETS, dropout=0.0):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(model, config)


def _loss_and_grads(model, input_ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, use_cache=False, **kwargs).logits
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture()
def per_projection_calls(monkeypatch):
    """How many projections ran the per-projection fused LoRA (not their group's output)."""
    calls = {"n": 0}
    original = lora_module.lora_linear

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(lora_module, "lora_linear", counting)
    return calls


@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_function_matches_separate_projections_in_float64(with_bias):
    """Different widths, ranks and scalings; every input gets its exact gradient (trained base weights too)."""
    gen = torch.Generator().manual_seed(5)
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=gen)  # noqa: E731
    d_in, outs, ranks, scalings = 12, (20, 6, 6), (4, 2, 3), (2.0, 0.5, 1.5)
    x = rnd(2, 5, d_in)
    ws = [rnd(o, d_in) for o in outs]
    bs = [rnd(o) if with_bias else None for o in outs]
    a_s = [rnd(r, d_in) for r in ranks]
    b_s = [rnd(o, r) for o, r in zip(outs, ranks, strict=True)]
    g = rnd(2, 5, sum(outs))
    leaves = lambda: [t.clone().requires_grad_() if t is not None else None for t in [x, *ws, *bs, *a_s, *b_s]]  # noqa: E731

    ref_in = leaves()
    xr, wr, br, ar, brr = ref_in[0], ref_in[1:4], ref_in[4:7], ref_in[7:10], ref_in[10:13]
    ref = torch.cat(
        [
            xr @ w.t() + (b if b is not None else 0) + s * (xr @ a.t()) @ bb.t()
            for w, b, a, bb, s in zip(wr, br, ar, brr, scalings, strict=True)
        ],
        dim=-1,
    )
    ref.backward(g)

    mine = leaves()
    out = grouped_lora_linear(mine[0], mine[1:4], mine[4:7], mine[7:10], mine[10:13], scalings)
    out.backward(g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for leaf, ref_leaf in zip(mine, ref_in, strict=True):
        if leaf is not None:
            torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-12, atol=1e-12)


def test_grouped_model_matches_peft_and_only_o_and_down_run_alone(small_qwen2, per_projection_calls):
    model = _peft(small_qwen2)
    input_ids = torch.randint(0, small_qwen2.config.vocab_size, (1, 11))
    ref_out, ref_grads = _loss_and_grads(model, input_ids)
    fuse_lora_linears(model)
    assert group_lora_projections(model) == {}
    assert count_grouped(model) == 2 * small_qwen2.config.num_hidden_layers  # self_attn and mlp of each layer
    per_projection_calls["n"] = 0
    out, grads = _loss_and_grads(model, input_ids)
    assert per_projection_calls["n"] == 2 * small_qwen2.config.num_hidden_layers  # o_proj, down_proj
    n = decoder_reduction_length(small_qwen2.config, input_ids.numel())  # fp32 rounding: tests/float_bounds.py
    torch.testing.assert_close(out, ref_out, **close(ref_out, n))
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **close(grad, n), msg=name)
    assert all(getattr(m, "_llmft_given", None) is None for m in model.modules())  # nothing left holding activations


@pytest.mark.slow
def test_compiled_layers_take_the_grouped_path_without_graph_breaks(per_projection_calls):
    """fullgraph=True: the hand-off from the parent to its children traces into one graph per layer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    model = _peft(Qwen2ForCausalLM(config).float().eval())
    input_ids = torch.randint(0, 97, (1, 10))
    ref_out, ref_grads = _loss_and_grads(model, input_ids)
    fuse_lora_linears(model)
    group_lora_projections(model)
    torch._dynamo.reset()
    for layer in (m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")):
        layer.compile(fullgraph=True, backend="aot_eager")
    per_projection_calls["n"] = 0
    out, grads = _loss_and_grads(model, input_ids)
    assert 0 < per_projection_calls["n"] <= 2 * config.num_hidden_layers  # traced: o/down only, never q/k/v/gate/up
    n = decoder_reduction_length(config, input_ids.numel())  # fp32 rounding: tests/float_bounds.py
    torch.testing.assert_close(out, ref_out, **close(ref_out, n))
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **close(grad, n), msg=name)
    torch._dynamo.reset()


def test_a_child_given_its_groups_output_still_computes_for_other_inputs(small_qwen2):
    """The hand-off is keyed on the very input tensor: any other input gets the child's own forward."""
    model = _peft(small_qwen2)
    fuse_lora_linears(model)
    group_lora_projections(model)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    x, other = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    q_proj._llmft_given = (x, torch.zeros(1, 3, 64))
    assert take_given_output(q_proj, other) is None and q_proj._llmft_given is not None
    assert not torch.equal(q_proj(other), torch.zeros(1, 3, 64))
    assert torch.equal(take_given_output(q_proj, x), torch.zeros(1, 3, 64)) and q_proj._llmft_given is None


def test_groups_need_every_sibling_fused(small_qwen2):
    """k_proj without LoRA: no q/k/v group; a sibling left on PEFT's forward prevents its group too."""
    model = _peft(small_qwen2, targets=["q_proj", "v_proj", "gate_proj", "up_proj"])
    fuse_lora_linears(model)
    assert group_lora_projections(model) == {}
    assert count_grouped(model) == small_qwen2.config.num_hidden_layers  # the MLPs only
    other = _peft(small_qwen2.__class__(small_qwen2.config))
    up_proj = other.base_model.model.model.layers[1].mlp.up_proj
    up_proj.lora_dropout["default"] = torch.nn.AlphaDropout(0.1)  # not reproduced by the fused path
    fuse_lora_linears(other)
    skipped = group_lora_projections(other)
    assert skipped == {"base_model.model.model.layers.1.mlp": "not every projection runs the fused LoRA forward"}
    assert count_grouped(other) == 2 * small_qwen2.config.num_hidden_layers - 1


def test_merged_and_unloaded_model_runs_the_plain_path(small_qwen2):
    """After merge_and_unload the children are plain linears: the grouped parent must step aside."""
    model = _peft(small_qwen2)
    input_ids = torch.randint(0, small_qwen2.config.vocab_size, (1, 6))
    fuse_lora_linears(model)
    group_lora_projections(model)
    with torch.no_grad():
        adapted = model(input_ids=input_ids, use_cache=False).logits
        merged = model.merge_and_unload()
        after = merged(input_ids=input_ids, use_cache=False).logits
    # merging rounds W + s·B·A once instead of adding two products: fp32 rounding (tests/float_bounds.py)
    torch.testing.assert_close(after, adapted, **close(adapted, decoder_reduction_length(merged.config, 6)))
