"""GPU checks of llmft/trainer/fastpath/moe.py on Qwen3-30B-A3B's layer widths: grouped experts
with LoRA against PEFT's ParamWrapper path (bf16, both measured against an fp32 copy), with the SiLU
product compiled (moe_rows.py), compiled layers, 4-bit experts (SiLU product compiled, as the trainer
runs them on CUDA) against their dequantized weights, and the time and peak memory of one
forward + backward of each path.

python -m llmft.benchmarks.gpu.check_moe --layers 2 --tokens 8192 --json-out F
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

from llmft.benchmarks.gpu import common
from llmft.benchmarks.gpu.check_kernels import bench, rel_err

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts"]


def _model(layers: int, dtype):
    # heavy: torch
    import torch

    # heavy: peft
    from peft import LoraConfig, get_peft_model

    # heavy: transformers
    from transformers import AutoModelForCausalLM

    # heavy: torch
    from llmft.trainer import moe_model

    config = common.hf_config("qwen3-30b-a3b")
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(config, dtype=dtype)
    net.set_experts_implementation("eager")
    spec = moe_model.peft_targets(TARGETS, net, 0.0)
    torch.manual_seed(1)
    lora = LoraConfig(r=16, lora_alpha=32, init_lora_weights=False, **spec)
    return get_peft_model(net, lora)


def _step(model, ids):
    """Logits and LoRA gradients of one forward + backward."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, use_cache=False).logits
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _errors(got, truth) -> dict:
    (out, grads), (ref_out, ref_grads) = got, truth
    return {
        "logits": rel_err(out, ref_out),
        "grads_max": max(rel_err(g, ref_grads[n]) for n, g in grads.items()),
    }


def _timed(model, ids) -> dict:
    # heavy: torch
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = bench(lambda: _step(model, ids), warmup=2, reps=5)
    return {"ms": ms, "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def run(layers: int, tokens: int, json_out: str) -> dict:
    """Each stage's result (or its error) is written to ``json_out`` as soon as it is known."""
    # heavy: torch
    import torch

    # heavy: torch
    from llmft.trainer.fastpath import moe

    # heavy: torch
    from llmft.trainer.fastpath.compile import compile_decoder_layers

    ids = torch.randint(0, 151936, (1, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    report: dict = {"layers": layers, "tokens": tokens, **common.device_info()}
    model = _model(layers, torch.bfloat16)
    truth = _step(copy.deepcopy(model).float(), ids)

    def stage(name, fn):
        try:
            report[name] = fn()
        except Exception as exc:  # noqa: BLE001 - a failed stage is a result too
            report[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        common.write_json(json_out, report)

    def measured():
        return {**_errors(_step(model, ids), truth), **_timed(model, ids)}

    stage("peft_eager", measured)
    model.get_base_model().set_experts_implementation("grouped_mm")
    stage("peft_grouped_mm", measured)
    stage("swap", lambda: moe.swap_grouped_experts(model))
    stage("llmft_grouped", measured)
    for block in moe.moe_blocks(model):  # the SiLU product as Inductor kernels (moe_rows.py)
        block.experts._llmft_compiled = True
    stage("llmft_grouped_rows_compiled", measured)
    compile_decoder_layers(model)
    stage("llmft_grouped_compiled", measured)
    model = None  # free the bf16 copy before the 4-bit models
    torch.cuda.empty_cache()
    stage("experts_4bit", lambda: _check_4bit(layers, ids))
    return report


def _check_4bit(layers: int, ids) -> dict:
    """4-bit experts: equal to the same model holding the dequantized weights; no weight kept for backward."""
    # heavy: torch
    import torch

    # heavy: torch
    from llmft.trainer.fastpath import moe

    model = _model(layers, torch.bfloat16)
    moe.quantize_experts_4bit(model)
    reference = _model(layers, torch.bfloat16)
    for block, ref in zip(moe.moe_blocks(model), moe.moe_blocks(reference), strict=True):
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                getattr(moe.base_experts(ref.experts), name).copy_(getattr(moe.base_experts(block.experts), name))
    out = {"swap": moe.swap_grouped_experts(model, compile_rows=True)}
    shape = tuple(moe.base_experts(moe.moe_blocks(model)[0].experts).gate_up_proj.shape)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        got = _step(model, ids)
    out.update(_errors(got, _step(reference, ids)))
    out["dequantized_weight_saved"] = shape in saved
    out.update(_timed(model, ids))
    out["weights_gib"] = torch.cuda.memory_allocated() / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--json-out", required=True)
    a = p.parse_args(argv)
    report = run(a.layers, a.tokens, a.json_out)
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
