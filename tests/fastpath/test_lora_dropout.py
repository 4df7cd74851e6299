"""LoRA dropout inside the fused (and grouped) LoRA path has PEFT's semantics, exactly.

The fused path makes each adapted linear's mask from two seed words it draws from torch's
generator (llmft/trainer/fastpath/dropout_mask.py: Philox-4x32-10 over (row, column), no stored mask;
on CUDA the same function in Triton kernels, checked bit for bit against this torch reference on
the device by llmft/benchmarks/gpu/check_kernels.py and in Triton's interpreter). PEFT is given the same
masks (its nn.Dropout modules swapped for one that draws the seed words the same way), so float64
outputs and every gradient agree to rounding.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from llmft.trainer.fastpath.dropout_mask import keep_mask, philox, threshold
from llmft.trainer.fastpath.lora import count_fused, fuse_lora_linears, lora_linear
from llmft.trainer.fastpath.lora_dropout import draw_seeds
from llmft.trainer.fastpath.lora_groups import count_grouped, group_lora_projections, grouped_lora_linear

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = dict(rtol=1e-10, atol=1e-12)  # float64: a different mask or a missing 1/(1-p) moves values by O(1)


class _SameMaskDropout(torch.nn.Module):
    """PEFT's dropout with the fused path's mask: seed words drawn when the linear runs, Philox mask."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training:
            return x
        seeds = draw_seeds(1, x.device)
        x2 = x.reshape(-1, x.shape[-1])
        return (x2 * keep_mask(seeds[0], *x2.shape, self.p) / (1 - self.p)).view(x.shape)


def _peft64(model, dropout: float):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    model = get_peft_model(model.double(), config).train()
    for module in model.modules():
        if hasattr(module, "lora_dropout"):
            for name, drop in module.lora_dropout.items():
                if isinstance(drop, torch.nn.Dropout):
                    module.lora_dropout[name] = _SameMaskDropout(drop.p)
    return model


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

    for module in model.modules():  # the fused path reads nn.Dropout's p (the swapped-in reference has the same)
        if hasattr(module, "lora_dropout"):
            for name, drop in module.lora_dropout.items():
                module.lora_dropout[name] = torch.nn.Dropout(drop.p)
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
    """y = x W^T + b + s ((x * m / (1 - p)) A^T) B^T with the Philox mask of the seed words the call draws;
    dx, dW, db, dA, dB."""
    gen = torch.Generator().manual_seed(3)
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=gen)  # noqa: E731
    p, s = 0.25, 1.5
    x, w, bias, a, b, g = rnd(2, 5, 12), rnd(20, 12), rnd(20), rnd(4, 12), rnd(20, 4), rnd(2, 5, 20)
    torch.manual_seed(11)
    mask = keep_mask(draw_seeds(1, x.device)[0], 10, 12, p)
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
    """Each sibling sees its own mask (its own seed words, drawn in call order); the base path sees x."""
    gen = torch.Generator().manual_seed(4)
    rnd = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=gen)  # noqa: E731
    d_in, outs, scalings, p = 10, (8, 4, 4), (2.0, 0.5, 1.0), 0.3
    x = rnd(1, 6, d_in)
    ws, a_s = [rnd(o, d_in) for o in outs], [rnd(2, d_in) for _ in outs]
    b_s = [rnd(o, 2) for o in outs]
    g = rnd(1, 6, sum(outs))
    ref_in = _leaves(x, *ws, *a_s, *b_s)
    xr, wr, ar, br = ref_in[0], ref_in[1:4], ref_in[4:7], ref_in[7:10]
    torch.manual_seed(5)
    dropout = _SameMaskDropout(p)
    parts = [xr @ w.t() + s * (dropout(xr) @ a.t()) @ b.t() for w, a, b, s in zip(wr, ar, br, scalings, strict=True)]
    ref = torch.cat(parts, dim=-1)
    ref.backward(g)
    mine = _leaves(x, *ws, *a_s, *b_s)
    torch.manual_seed(5)
    out = grouped_lora_linear(mine[0], mine[1:4], [None] * 3, mine[4:7], mine[7:10], scalings, (p,) * 3)
    out.backward(g)
    torch.testing.assert_close(out, ref, **TOL)
    for leaf, ref_leaf in zip(mine, ref_in, strict=True):
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, **TOL)


def test_siblings_with_different_dropouts_are_not_grouped(small_qwen2):
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(small_qwen2, config).train()
    for layer in model.base_model.model.model.layers:
        layer.self_attn.k_proj.lora_dropout["default"] = torch.nn.Dropout(0.2)
    fuse_lora_linears(model)
    skipped = group_lora_projections(model)
    assert count_grouped(model) == 2  # the two gate/up pairs
    assert all("dropout" in reason for reason in skipped.values()) and len(skipped) == 2


def test_philox_is_philox4x32_10():
    """Random123's known-answer vectors (kat_vectors: philox4x32, 10 rounds): the torch reference of the
    kernels' generator is the standard one."""
    cases = [
        ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0xA4093822, 0x299F31D0),
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for key, counter, want in cases:
        seed = torch.tensor(key, dtype=torch.int64).to(torch.int32)  # the low 32 bits, as the kernels read them
        got = philox(seed, *(torch.tensor([c]) for c in counter))
        assert [int(w) for w in got] == list(want)


def test_mask_keeps_one_minus_p_and_depends_on_seed_row_and_column():
    seeds = torch.tensor([[12345, -678], [12345, -677]], dtype=torch.int32)
    a = keep_mask(seeds[0], 512, 256, 0.05)
    b = keep_mask(seeds[1], 512, 256, 0.05)
    n = a.numel()
    assert abs(a.float().mean().item() - (1 - threshold(0.05) / 65536)) < 4 * (0.05 * 0.95 / n) ** 0.5
    assert (a != b).float().mean() > 0.05  # another seed: another mask
    assert (a[:-1] != a[1:]).any(1).all() and (a[:, :-8] != a[:, 8:]).any(0).all()  # rows, column groups differ
    assert torch.equal(keep_mask(seeds[0], 512, 256, 0.05), a)  # a pure function of the seed


def test_masks_are_bitwise_reproducible_from_the_checkpointed_generator_state():
    """Resume: the trainer restores each rank's generator state (checkpoint.rng_state / set_rng_state);
    from it the fused path draws the same seed words, so the same masks and the same bits."""
    from llmft.trainer.checkpoint import rng_state, set_rng_state

    gen = torch.Generator().manual_seed(8)
    x, w, a, b = (torch.randn(*s, generator=gen) for s in ((3, 7, 16), (24, 16), (4, 16), (24, 4)))
    torch.manual_seed(123)
    state = rng_state()
    first = [lora_linear(x, w, None, a, b, 2.0, dropout=0.1) for _ in range(3)]
    set_rng_state(state)
    again = [lora_linear(x, w, None, a, b, 2.0, dropout=0.1) for _ in range(3)]
    for one, two in zip(first, again, strict=True):
        assert torch.equal(one, two)
    assert not torch.equal(first[0], first[1])  # each call draws new seed words


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
