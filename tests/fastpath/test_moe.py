"""Mixture-of-experts fast path (llmft/trainer/fastpath/moe.py) on a tiny random Qwen3-MoE:
grouped experts with LoRA equal transformers' eager experts under PEFT, outputs and gradients;
LoRA targets keep the router frozen; 4-bit experts; FLOPs over active parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from moe_model import tiny_moe, tiny_moe_config
from peft import LoraConfig, get_peft_model

from llmft.trainer import flops, moe_model
from llmft.trainer.errors import ConfigError
from llmft.trainer.fastpath import moe, moe_rows

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _peft(model, targets, dropout=0.0):
    spec = moe_model.peft_targets(targets, model, dropout)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False, **spec)
    torch.manual_seed(1)  # init_lora_weights=False: random A and B, so every path carries signal
    return get_peft_model(model, config)


def _eager(model):
    model.get_base_model().set_experts_implementation("eager")  # transformers' per-expert loop
    return model


def _run(model, input_ids):
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
    out = model(inputs_embeds=embeds, use_cache=False).logits
    (out**2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads, embeds.grad.clone()


def _assert_same(a, b, rtol, atol):
    (out_a, grads_a, dx_a), (out_b, grads_b, dx_b) = a, b
    torch.testing.assert_close(out_a, out_b, rtol=rtol, atol=atol)
    torch.testing.assert_close(dx_a, dx_b, rtol=rtol, atol=atol)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[name], rtol=rtol, atol=atol, msg=name)


def test_grouped_lora_experts_equal_peft_in_float64():
    """float64, so any difference is a wrong formula, not rounding: tolerance = 1e3 x eps64."""
    reference = _eager(_peft(tiny_moe(torch.float64), [*ATTENTION, "experts"]))
    fast = copy.deepcopy(reference)
    report = moe.swap_grouped_experts(fast)
    assert report["lora_experts"] == 2 and report["kernel"] == "loop" and not report["kept"]
    input_ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    ref, new = _run(reference, input_ids), _run(fast, input_ids)
    expert_grads = [n for n in ref[1] if ".experts." in n]
    assert len(expert_grads) == 2 * 2 * 2  # 2 layers x (gate_up, down) x (A, B)
    assert all(ref[1][n].abs().max() > 0 for n in expert_grads)
    tol = 1e3 * torch.finfo(torch.float64).eps
    _assert_same(new, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("targets", [["experts.down_proj"], ["q_proj", "experts.gate_up_proj"]])
def test_one_expert_tensor_adapted(targets):
    reference = _eager(_peft(tiny_moe(torch.float64), targets))
    fast = copy.deepcopy(reference)
    assert moe.swap_grouped_experts(fast)["lora_experts"] == 2
    input_ids = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(2))
    tol = 1e3 * torch.finfo(torch.float64).eps
    _assert_same(_run(fast, input_ids), _run(reference, input_ids), rtol=tol, atol=tol)


def test_grouped_mm_kernel_in_float32_is_as_close_as_the_eager_loop():
    """The torch.grouped_mm kernel (fp32, CPU) against the float64 truth: its error is bounded by
    the eager fp32 loop's own error (same sums, different order), not by a hand-picked number."""
    truth = _eager(_peft(tiny_moe(torch.float64), [*ATTENTION, "experts"]))
    eager32 = copy.deepcopy(truth).float()
    fast32 = copy.deepcopy(eager32)
    assert moe.swap_grouped_experts(fast32)["kernel"] == "torch.grouped_mm"
    input_ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    out64, grads64, _ = _run(truth, input_ids)
    for model in (eager32, fast32):
        model._err = _run(model, input_ids)
    for i, (ref, name) in enumerate([(out64, "logits")] + [(g, n) for n, g in grads64.items()]):
        got_eager = eager32._err[0] if i == 0 else eager32._err[1][name]
        got_fast = fast32._err[0] if i == 0 else fast32._err[1][name]
        bound = 4 * (got_eager.double() - ref).abs().max() + 8 * torch.finfo(torch.float32).eps * ref.abs().max()
        assert (got_fast.double() - ref).abs().max() <= bound, name


def test_disabled_adapter_falls_back_to_the_base_experts():
    base = tiny_moe(torch.float64)
    base.set_experts_implementation("eager")
    model = _peft(copy.deepcopy(base), ["experts"])
    moe.swap_grouped_experts(model)
    input_ids = torch.randint(0, 97, (1, 7))
    with torch.no_grad(), model.disable_adapter():
        off = model(input_ids=input_ids).logits
    with torch.no_grad():
        torch.testing.assert_close(off, base(input_ids=input_ids).logits)
        assert not torch.allclose(model(input_ids=input_ids).logits, off)


# ----------------------------------------------------------------------------- targets and router


def test_all_linear_is_attention_only_and_the_router_stays_frozen():
    model = _peft(tiny_moe(), ["all-linear"])
    adapted = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == set(ATTENTION)  # PEFT alone would also adapt gate.weight and both expert tensors
    assert moe.apply_moe(model)["routers_frozen"] == 2
    routers = [b.gate.weight for b in moe_model.moe_blocks(model)]
    input_ids = torch.randint(0, 97, (1, 9))
    model(input_ids=input_ids).logits.sum().backward()
    assert all(not w.requires_grad and w.grad is None for w in routers)


def test_experts_option_maps_to_peft_target_parameters():
    spec = moe_model.peft_targets(["q_proj", "experts"], tiny_moe(), 0.0)
    assert spec == {"target_modules": ["q_proj"], "target_parameters": ["experts.down_proj", "experts.gate_up_proj"]}


@pytest.mark.parametrize(
    "targets, dropout, message",
    [
        (["q_proj", "gate"], 0.0, "is the MoE router, which stays frozen"),
        (["q_proj", "gate_proj"], 0.0, "has no ['gate_proj'] layers"),
        (["q_proj", "experts"], 0.05, "set lora.dropout=0"),
    ],
)
def test_bad_moe_targets_are_refused_with_the_fix(targets, dropout, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        moe_model.peft_targets(targets, tiny_moe(), dropout)


def test_targets_are_checked_from_config_json_before_loading(tmp_path):
    from llmft.trainer.config_load import load_config

    tiny_moe_config().save_pretrained(tmp_path)  # config only: no weights needed for the check
    base = [f"model.name_or_path={tmp_path}", "data=/nowhere", "lora.dropout=0.05"]
    moe_model.check_lora_config(load_config(None, [*base, "lora.target_modules=[q_proj,v_proj]"]))
    with pytest.raises(ConfigError, match="set lora.dropout=0"):
        moe_model.check_lora_config(load_config(None, [*base, "lora.target_modules=[q_proj,experts]"]))


def test_a_router_adapter_is_refused():
    model = get_peft_model(tiny_moe(), LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["gate.weight"]))
    with pytest.raises(ConfigError, match="router must stay frozen"):
        moe_model.freeze_routers(model)


# ----------------------------------------------------------------------------- 4-bit experts


def test_4bit_experts_equal_their_dequantized_weights_and_are_never_saved():
    pytest.importorskip("bitsandbytes")
    model = _peft(tiny_moe(), [*ATTENTION, "experts"])
    reference = copy.deepcopy(model)
    assert moe.quantize_experts_4bit(model) == 2
    for block, ref_block in zip(moe_model.moe_blocks(model), moe_model.moe_blocks(reference), strict=True):
        experts, ref_experts = moe_model.base_experts(block.experts), moe_model.base_experts(ref_block.experts)
        with torch.no_grad():  # the reference holds exactly the weights the 4-bit store gives back
            ref_experts.gate_up_proj.copy_(experts.gate_up_proj)
            ref_experts.down_proj.copy_(experts.down_proj)
    report = moe.apply_moe(model)
    assert report["experts_4bit"] == 2 and report["lora_experts"] == 2
    shapes = {tuple(moe_model.base_experts(b.experts).gate_up_proj.shape) for b in moe_model.moe_blocks(model)}
    saved = []
    input_ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        new = _run(model, input_ids)
    assert not shapes & set(saved), "a dequantized expert weight was kept for backward"
    ref = _run(_eager(reference), input_ids)
    tol = 64 * torch.finfo(torch.float32).eps
    _assert_same(new, ref, rtol=tol, atol=tol)


def _compiled_graphs_of_a_4bit_moe(layers: int) -> int:
    """Distinct graphs dynamo captures for one forward + backward of compiled decoder layers."""
    from torch._dynamo.utils import counters

    from llmft.trainer.fastpath.compile import compile_decoder_layers

    model = _peft(tiny_moe(num_hidden_layers=layers), ATTENTION)
    moe.quantize_experts_4bit(model)
    moe.apply_moe(model)
    torch._dynamo.reset()
    counters.clear()
    compile_decoder_layers(model, backend="eager")
    model(input_ids=torch.arange(12).unsqueeze(0), use_cache=False).logits.sum().backward()
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow  # torch.compile of a 4-bit MoE model: about 5 s
def test_4bit_experts_compile_once_for_every_layer():
    """parametrize gives each module its own class and compiled code guards on it: the 48 layers of the
    Qwen3-30B-A3B shape recompiled the MoE block per layer, past dynamo's limit (H200, 2026-11-26).
    One shared class: the number of graphs does not grow with the number of layers."""
    pytest.importorskip("bitsandbytes")
    try:
        assert _compiled_graphs_of_a_4bit_moe(2) == _compiled_graphs_of_a_4bit_moe(6)
    finally:
        torch._dynamo.reset()  # no compiled layers leak into the tests after this one


def test_frozen_fp32_parameters_go_back_to_bf16_and_adapters_stay_fp32():
    """What PEFT's kbit preparation upcasts (norms, embeddings, router, lm_head) returns to the compute dtype."""
    model = _peft(tiny_moe(), ATTENTION)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert moe.frozen_to_compute_dtype(model, torch.bfloat16) == len(frozen)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {dtypes[n] for n in frozen} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}


# ----------------------------------------------------------------------------- FLOPs


def test_flops_count_active_parameters_of_the_model():
    """flops.matmul_params = the matmul weights one token uses, counted here from the model itself."""
    model = tiny_moe()
    shape = flops.shape_from_config(model.config)
    assert (shape.n_experts, shape.experts_per_token, shape.moe_layers) == (4, 2, 2)
    used = model.lm_head.weight.numel()
    for layer in model.model.layers:
        used += sum(getattr(layer.self_attn, n).weight.numel() for n in ATTENTION)
        used += layer.mlp.gate.weight.numel()
        experts = layer.mlp.experts
        used += (experts.gate_up_proj.numel() + experts.down_proj.numel()) * 2 // 4  # top-2 of 4
    assert flops.matmul_params(shape) == used


def test_flops_of_the_qwen3_30b_a3b_shape():
    shape = flops.shape_from_config(
        {
            "num_hidden_layers": 48,
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": 151936,
        }
    )
    attention = 2 * 2048 * 4096 + 2 * 2048 * 512
    per_layer = attention + 2048 * 128 + 8 * (2048 * 1536 + 768 * 2048)
    assert flops.matmul_params(shape) == 48 * per_layer + 151936 * 2048
    assert 3.0e9 < flops.matmul_params(shape) < 3.1e9  # + 0.31e9 embedding = Qwen's "3.3B activated"
    attention_lora = 48 * 6 * 16 * (2 * (2048 + 4096) + 2 * (2048 + 512))
    assert flops.lora_adapter_flops_per_token(shape, 16, ATTENTION) == attention_lora
    assert flops.lora_adapter_flops_per_token(shape, 16) == attention_lora  # all-linear on MoE layers
    experts = 48 * 6 * 16 * 8 * ((2048 + 1536) + (768 + 2048))
    assert flops.lora_adapter_flops_per_token(shape, 16, [*ATTENTION, "experts", "base_layer"]) == (
        attention_lora + experts
    )


# ----------------------------------------------------------------------------- routing and the expert MLP


def _routing_inputs(tokens=13, experts=4, top_k=2, hidden=8, seed=5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen, dtype=dtype)
    return torch.randn(tokens, hidden, generator=gen, dtype=dtype), index, weights


def test_routing_offsets_and_row_moves_are_adjoint():
    """Offsets are bincount's running sum; gather and combine are each other's transpose (so their
    gradients are each other), checked in float64 by gradcheck and against the indexing they replace."""
    x, index, _ = _routing_inputs()
    routing = moe_rows.Routing(index, 4)
    assert torch.equal(routing.offs, torch.cumsum(torch.bincount(index.reshape(-1), minlength=4), 0).int())
    rows = routing.gather(x)
    assert torch.equal(rows, x[routing.order // 2])
    assert torch.equal(routing.combine(rows), 2 * x)  # each token's 2 rows summed back
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(routing.gather, (x,))
    z = torch.randn(rows.shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(routing.combine, (z,))


def test_scaled_swiglu_equals_the_separate_ops_and_its_gradient():
    gate_up = torch.randn(7, 10, dtype=torch.float64, requires_grad=True)
    w = torch.rand(7, dtype=torch.float64, requires_grad=True)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up * w.unsqueeze(-1)
    for compiled in (False, True):  # compiled: Inductor's C++ kernels here, Triton on CUDA
        node = lambda g, v, c=compiled: moe_rows._SwiGLUScaled.apply(g, v, c)  # noqa: E731
        torch.testing.assert_close(node(gate_up, w), ref, rtol=0, atol=1e-15)
        assert torch.autograd.gradcheck(node, (gate_up, w))


def test_grouped_experts_never_wait_on_the_host(monkeypatch):
    """Routing without a device-to-host read: torch.bincount reads the ids' min and max back on CUDA
    (a sync per layer and micro step before); the kernel path, forward and backward, reads nothing back."""
    model = tiny_moe(torch.float32)
    experts = moe_model.base_experts(moe_model.moe_blocks(model)[0].experts)
    x, index, weights = _routing_inputs(dtype=torch.float32, hidden=32)
    x.requires_grad_(True)
    weights.requires_grad_(True)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync")

    monkeypatch.setattr(torch, "bincount", refuse)
    for name in ("item", "tolist", "__bool__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = moe.grouped_experts(experts, x, index, weights, kernel="torch.grouped_mm")
    out.sum().backward()
    monkeypatch.undo()
    reference = moe.grouped_experts(experts, x.detach(), index, weights.detach(), kernel="loop")
    torch.testing.assert_close(out.detach(), reference)


def test_4bit_experts_keep_only_the_gate_up_output_and_routing_weights():
    """Per routed row the backward needs the gate/up output [S, 2I] and the routing weight [S]: no [S, H]
    expert output (the routing weight multiplies the down projection's input) and no SiLU or product kept."""
    pytest.importorskip("bitsandbytes")
    model = tiny_moe(torch.float32)
    moe.quantize_experts_4bit(model)
    experts = moe_model.base_experts(moe_model.moe_blocks(model)[0].experts)
    x, index, weights = _routing_inputs(dtype=torch.float32, hidden=32)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = moe.grouped_experts(experts, x, index, weights, kernel="torch.grouped_mm")
    rows = index.numel()
    assert {s for s in saved if s and s[0] == rows} == {(rows, 2 * 16), (rows,)}
    out.sum().backward()
    assert x.grad is not None and weights.grad.abs().sum() > 0


@pytest.mark.slow  # Inductor compiles two small C++ kernels on CPU: about 20 s
def test_compiled_swiglu_runs_compiled_inside_the_experts_eager_region():
    """moe.py runs the experts outside the compiled layers (torch.compiler.disable); the SiLU product called
    from there still runs as compiled kernels, once for any row count, and gives the eager path's results
    (float32: within a few rounding steps of the same sums)."""
    from torch._dynamo.utils import counters

    model = tiny_moe(torch.float32)
    experts = moe_model.base_experts(moe_model.moe_blocks(model)[0].experts)
    torch._dynamo.reset()
    counters.clear()
    run = torch.compiler.disable(
        lambda x, i, w, c: moe.grouped_experts(experts, x, i, w, kernel="torch.grouped_mm", compiled=c)
    )
    try:
        for tokens in (13, 29):  # two row counts: no second compile
            x, index, weights = _routing_inputs(tokens=tokens, dtype=torch.float32, hidden=32)
            results = []
            for compiled in (False, True):
                xg, wg = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
                out = run(xg, index, wg, compiled)
                (out**2).sum().backward()
                results.append((out.detach(), xg.grad, wg.grad))
            for eager, fast in zip(*results, strict=True):
                torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-6)
        assert counters["stats"]["unique_graphs"] == 2  # SwiGLU forward and backward
    finally:
        torch._dynamo.reset()
