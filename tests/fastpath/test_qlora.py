"""The fused LoRA path over 4-bit bases (llmft/trainer/fastpath/qlora.py) computes what PEFT's lora.Linear4bit
computes, on real bitsandbytes 4-bit layers (its CPU backend: tests/fastpath/qlora_model.py).

- float64: the fused node against the formula with bitsandbytes' own dequantized weight: exact up to
  float64 rounding (tests/float_bounds.py), dropout masks included;
- float32: a PEFT QLoRA Qwen2 (lora.Linear4bit over bnb Linear4bit) fused and grouped, outputs and every
  adapter gradient to float32 rounding, eager and compiled (AOTAutograd's partitioner, fullgraph);
- bfloat16 (the product's dtype): fused and PEFT against float64, both within the rounding bound of
  the bf16 steps (derived in :func:`_bf16_bound`);
- memory: no dequantized weight is kept for the backward, and a bf16 QLoRA model keeps no float32
  activation (PEFT's kbit preparation, which the trainer no longer runs, is what made them float32).
"""

from __future__ import annotations

import copy

import pytest
import torch
from float_bounds import close, decoder_reduction_length, eps

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model  # noqa: E402
from qlora_model import TARGETS, dequantized, linear_4bit, to_4bit  # noqa: E402

from llmft.trainer.fastpath import qlora  # noqa: E402
from llmft.trainer.fastpath.lora import count_fused, fuse_lora_linears  # noqa: E402
from llmft.trainer.fastpath.lora_groups import count_grouped, group_lora_projections  # noqa: E402


def _qwen2(dtype=torch.float32, attn="sdpa", layers=2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attn_implementation=attn,
    )
    return Qwen2ForCausalLM(config).to(dtype).eval()


def _peft(model, dropout=0.0):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(model, config).train()


def _run(model, input_ids, seed=7):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=input_ids, use_cache=False).logits
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_same_run(run, ref, n):
    (out, grads), (ref_out, ref_grads) = run, ref
    torch.testing.assert_close(out, ref_out, **close(ref_out, n))
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **close(grad, n), msg=name)


# ----------------------------------------------------------------------------- the node, float64


@pytest.mark.parametrize("siblings", [1, 3])
@pytest.mark.parametrize("mode", ["concat", "epilogue"])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
@pytest.mark.parametrize("double_quant, storage", [(True, torch.uint8), (False, torch.bfloat16)])
def test_fused_4bit_node_is_the_formula_in_float64(siblings, mode, dropout, double_quant, storage):
    """y_i = x W_i^T + b_i + s_i (drop_i(x) A_i^T) B_i^T with W_i = bitsandbytes' dequantized weight; every
    input's gradient. Masks: native_dropout (nn.Dropout's kernel), one per sibling, in order (PEFT's draw)."""
    gen = torch.Generator().manual_seed(5)
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=gen)  # noqa: E731
    d_in, outs, ranks, scalings = 64, (96, 32, 32)[:siblings], (4, 2, 3)[:siblings], (2.0, 0.5, 1.5)[:siblings]
    bases = [
        linear_4bit(torch.nn.Linear(d_in, o), torch.float32, double_quant=double_quant, storage=storage) for o in outs
    ]
    weights = [dequantized(b).double() for b in bases]
    x, g = rnd(2, 5, d_in), rnd(2, 5, sum(outs))
    a_s, b_s = [rnd(r, d_in) for r in ranks], [rnd(o, r) for o, r in zip(outs, ranks, strict=True)]
    for base in bases:  # float64 biases that take a gradient (frozen in LoRA; the node still gets them right)
        base.bias = torch.nn.Parameter(base.bias.detach().double())
    leaves = lambda: [t.clone().requires_grad_() for t in [x, *a_s, *b_s]]  # noqa: E731

    torch.manual_seed(11)
    masks = [torch.native_dropout(x.reshape(-1, d_in), dropout, True)[1] if dropout else None for _ in outs]
    ref_in = leaves()
    xr, ar, br = ref_in[0], ref_in[1 : 1 + siblings], ref_in[1 + siblings :]
    parts = []
    for i in range(siblings):
        xd = xr if masks[i] is None else xr * masks[i].view(x.shape) / (1 - dropout)
        parts.append(xr @ weights[i].t() + bases[i].bias + scalings[i] * (xd @ ar[i].t()) @ br[i].t())
    ref = torch.cat(parts, dim=-1)
    ref.backward(g)
    ref_bias_grads = [b.bias.grad for b in bases]
    for base in bases:
        base.bias.grad = None

    mine = leaves()
    torch.manual_seed(11)
    drops = [dropout] * siblings
    out = qlora.lora_4bit_linear(mine[0], bases, mine[1 : 1 + siblings], mine[1 + siblings :], scalings, drops, mode)
    out.backward(g)
    n = d_in + max(ranks) + 10  # longest reductions: K (+ r) forward, the 10 tokens in dA / dB / dbias
    torch.testing.assert_close(out, ref, **close(ref, n, torch.float64))
    for leaf, ref_leaf in zip(mine, ref_in, strict=True):
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, **close(ref_leaf.grad, n, torch.float64))
    for base, ref_grad in zip(bases, ref_bias_grads, strict=True):
        torch.testing.assert_close(base.bias.grad, ref_grad, **close(ref_grad, n, torch.float64))


# ----------------------------------------------------------------------------- a PEFT QLoRA model, float32


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fused_and_grouped_qlora_equals_peft_linear4bit(dropout):
    model = _peft(to_4bit(_qwen2()), dropout)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__module__ == "peft.tuners.lora.bnb" and type(q_proj).__name__ == "Linear4bit"
    input_ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    ref = _run(model, input_ids)
    if dropout:
        assert not torch.allclose(_run(model, input_ids, seed=8)[0], ref[0])  # dropout really is on
    assert fuse_lora_linears(model) == {} and count_fused(model) == 2 * len(TARGETS)
    assert group_lora_projections(model) == {} and count_grouped(model) == 4
    fused = _run(model, input_ids)
    assert len(fused[1]) == 4 * len(TARGETS)  # every adapter (A and B of 14 linears) got a gradient
    _assert_same_run(fused, ref, decoder_reduction_length(model.config, input_ids.numel()))


@pytest.mark.slow
def test_compiled_qlora_layers_trace_in_one_graph_and_keep_no_dequantized_weight():
    """fullgraph=True through AOTAutograd's min-cut partitioner (with its CSE): same numbers, and no
    tensor of a (stacked) dequantized weight's shape among the saved ones."""
    model = _peft(to_4bit(_qwen2()), dropout=0.1)
    input_ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(4))
    fuse_lora_linears(model)
    group_lora_projections(model)
    ref = _run(model, input_ids)
    torch._dynamo.reset()
    for layer in (m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")):
        layer.compile(fullgraph=True, backend="aot_eager")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        compiled = _run(model, input_ids)
    torch._dynamo.reset()
    _assert_same_run(compiled, ref, decoder_reduction_length(model.config, input_ids.numel()))
    # every (stacked) weight the node dequantizes, [out, in], and with the adapters folded in, [out, in + r]
    weight_shapes = set()
    for outs, d_in, rank in (((64, 32, 32), 64, 12), ((96, 96), 64, 8), ((64,), 64, 4), ((64,), 96, 4)):
        for w in (*outs, sum(outs)):
            weight_shapes |= {(w, d_in), (d_in, w), (w, d_in + rank), (d_in + rank, w)}
    kept = {shape for shape, dtype in saved if dtype.is_floating_point} & weight_shapes
    assert not kept, f"dequantized weights kept for backward: {kept}"
    assert saved, "the saved-tensor hook saw nothing: the test would pass vacuously"


# ----------------------------------------------------------------------------- bfloat16, the product's dtype


def _bf16_bound(abs_value: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on a bf16 result's error: every value here is a sum of products of bf16 inputs
    (exact), accumulated in fp32 (K·2^-24 relative, negligible) and rounded in at most 6 steps (A and B
    cast to bf16, s·B, h, the output or gradient itself, and PEFT's casts of its fp32 adapter output)
    of at most u = eps/2 each: |error| <= 6·u·Σ|terms|. ``abs_value`` is Σ|terms|, the same formula
    evaluated on the inputs' absolute values."""
    return 6 * (eps(torch.bfloat16) / 2) * abs_value + 64 * eps(torch.float32) * abs_value


@pytest.mark.parametrize("siblings", [1, 2])
def test_bf16_fused_4bit_is_within_bf16_rounding_of_exact_like_peft(siblings):
    """gate/up as a group (2) and down_proj alone (1), in bf16 with fp32 adapters: the fused node and PEFT's
    lora.Linear4bit both land within the bf16 rounding bound of the exact (float64) values."""
    model = _peft(to_4bit(_qwen2(torch.bfloat16)))
    mlp = model.base_model.model.model.layers[0].mlp
    members = [mlp.gate_proj, mlp.up_proj] if siblings == 2 else [mlp.down_proj]
    d_in = members[0].in_features
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(7, d_in, generator=gen).to(torch.bfloat16)
    g = torch.randn(7, sum(m.out_features for m in members), generator=gen).to(torch.bfloat16)

    def exact(absolute: bool):
        f = (lambda t: t.detach().double().abs()) if absolute else (lambda t: t.detach().double())  # noqa: E731
        xe = f(x).requires_grad_()
        lora = [
            (f(m.lora_A["default"].weight).requires_grad_(), f(m.lora_B["default"].weight).requires_grad_())
            for m in members
        ]
        ws = [f(dequantized(m.get_base_layer(), torch.bfloat16)) for m in members]
        out = torch.cat(
            [
                xe @ w.t() + m.scaling["default"] * (xe @ a.t()) @ b.t()
                for w, (a, b), m in zip(ws, lora, members, strict=True)
            ],
            dim=-1,
        )
        out.backward(f(g))
        return [out.detach(), xe.grad, *[t.grad for pair in lora for t in pair]]

    def measured(fused: bool):
        for m in members:
            m.zero_grad(set_to_none=True)
        xm = x.clone().requires_grad_()
        if fused:
            bases = [m.get_base_layer() for m in members]
            lora_as = [m.lora_A["default"].weight for m in members]
            lora_bs = [m.lora_B["default"].weight for m in members]
            out = qlora.lora_4bit_linear(xm, bases, lora_as, lora_bs, [m.scaling["default"] for m in members])
        else:
            out = torch.cat([m(xm) for m in members], dim=-1)
        out.backward(g)
        grads = [t.grad for m in members for t in (m.lora_A["default"].weight, m.lora_B["default"].weight)]
        return [out.detach(), xm.grad, *grads]

    truth, size = exact(False), exact(True)
    assert measured(True)[0].dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in measured(True)[2:])
    for fused in (False, True):
        for value, ref, scale in zip(measured(fused), truth, size, strict=True):
            error = (value.double() - ref).abs()
            assert (error <= _bf16_bound(scale)).all(), (fused, float((error - _bf16_bound(scale)).max()))


# ----------------------------------------------------------------------------- memory: bf16 end to end


def _saved_float32_widths(model, input_ids) -> set[int]:
    """Last dimensions of the float32 activations autograd keeps (parameters excluded) in one step."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = []
    hook = lambda t: saved.append(t) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(hook, lambda t: t):
        out = model(input_ids=input_ids, use_cache=False).logits
    out.float().square().mean().backward()
    return {t.shape[-1] for t in saved if t.dtype == torch.float32 and t.dim() and t.data_ptr() not in params}


@pytest.mark.slow
def test_trainer_qlora_computes_in_bf16_and_keeps_no_float32_projection_activation():
    """trainer.model.apply_lora(qlora=True): frozen parameters stay bf16 (no kbit upcast), adapters fp32;
    with the fused path no float32 tensor of a projection's width (k/v 32, MLP 96, q/k/v 128, gate/up 192)
    is kept for the backward. Both contrasts keep some: PEFT's kbit preparation (what the trainer ran
    before: every activation float32) and PEFT's own lora.Linear4bit (its fp32 cast of down_proj's input)."""
    from peft import prepare_model_for_kbit_training

    from llmft.trainer.config import LoraConfig as TrainerLoraConfig
    from llmft.trainer.model import apply_lora

    lora = TrainerLoraConfig(r=4, alpha=8, dropout=0.05, target_modules=tuple(TARGETS))
    base = to_4bit(_qwen2(torch.bfloat16))
    input_ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(6))
    projection_widths = {32, 96, 128, 192}

    upcast = get_peft_model(
        prepare_model_for_kbit_training(copy.deepcopy(base), use_gradient_checkpointing=False),
        LoraConfig(r=4, target_modules=TARGETS),
    ).train()
    assert 96 in _saved_float32_widths(upcast, input_ids)  # the MLP in float32: the [tokens, 8960] of the H100 run

    model = apply_lora(base, lora, qlora=True).train()
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.dtype.is_floating_point}
    assert frozen == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert 96 in _saved_float32_widths(model, input_ids)  # PEFT's Linear4bit: fp32 copy of down_proj's input
    assert fuse_lora_linears(model) == {} and group_lora_projections(model) == {}
    assert not _saved_float32_widths(model, input_ids) & projection_widths


# ----------------------------------------------------------------------------- which modules fuse and group


def test_siblings_group_only_with_one_quantization_layout():
    """k_proj without double quantization: q/k/v cannot share one stacked weight, each runs its own fused
    node; a plain k_proj beside 4-bit q/v does not group either; gate/up still do."""
    other_layout = to_4bit(_qwen2(), skip=("k_proj",))
    for layer in other_layout.model.layers:
        layer.self_attn.k_proj = linear_4bit(layer.self_attn.k_proj, torch.float32, double_quant=False)
    mixed = to_4bit(_qwen2(), skip=("k_proj",))
    input_ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    for base, reason in (
        (other_layout, "4-bit projections differ in input width or quantization layout (block size, type, storage)"),
        (mixed, "some projections are 4-bit and some are not"),
    ):
        model = _peft(base)
        ref = _run(model, input_ids)
        assert fuse_lora_linears(model) == {} and count_fused(model) == 2 * len(TARGETS)
        skipped = group_lora_projections(model)
        assert skipped == {f"base_model.model.model.layers.{i}.self_attn": reason for i in range(2)}
        assert count_grouped(model) == 2  # the MLPs
        _assert_same_run(_run(model, input_ids), ref, decoder_reduction_length(model.config, input_ids.numel()))


def test_disabled_adapters_fall_back_to_the_4bit_base():
    model = _peft(to_4bit(_qwen2()))
    input_ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=input_ids, use_cache=False).logits
    fuse_lora_linears(model)
    group_lora_projections(model)
    with torch.no_grad():
        adapted = model(input_ids=input_ids, use_cache=False).logits
        with model.disable_adapter():
            disabled = model(input_ids=input_ids, use_cache=False).logits
    torch.testing.assert_close(disabled, base, rtol=0, atol=0)  # PEFT's own forward: the same operations
    assert not torch.allclose(adapted, base)
