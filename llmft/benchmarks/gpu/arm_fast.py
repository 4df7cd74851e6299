"""The fast path on its own (no trainer around it): packed rows, llmft_varlen
attention, fused LoRA linears, fused linear cross-entropy over supervised
tokens, compiled decoder layers, fused AdamW. It measures what
llmft/trainer/fastpath can do, so the project arm (the real trainer, `python -m
llmft.trainer`) can be compared against it.

python -m llmft.benchmarks.gpu.arm_fast --model qwen2.5-1.5b --method lora --json-out F
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from llmft.benchmarks.gpu import common
from llmft.trainer import flops
from llmft.trainer.data.shards import position_ids_for

DEVICE = "cuda"  # a CPU smoke run sets "cpu"


def packed_micro_batches(samples: common.Samples, per_step: int, micro: int, steps: int):
    """Host-side packed rows: for each step, a list of micro-batches (dicts of numpy arrays)."""

    plan = []
    for step in range(steps):
        micros = []
        for lo in range(step * per_step, (step + 1) * per_step, micro):
            idx = range(lo, lo + micro)
            lengths = samples.lengths[lo : lo + micro]
            ids = np.concatenate([samples.input_ids[i] for i in idx])
            targets = np.concatenate([common.supervised_targets(samples.labels[i]) for i in idx])
            micros.append(
                {
                    "input_ids": ids,
                    "targets": targets,
                    "position_ids": position_ids_for(lengths),
                    "lengths": lengths,
                    "select": np.nonzero(targets != common.IGNORE_INDEX)[0],
                }
            )
        plan.append(micros)
    return plan


def to_device(mb: dict) -> dict:
    # heavy: torch
    import torch

    # heavy: torch
    from llmft.trainer.fastpath.attention import packed_attention_kwargs

    def put(array, dtype):
        host = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        if DEVICE == "cuda":
            host = host.pin_memory()
        return host.to(DEVICE, non_blocking=True)

    return {
        "input_ids": put(mb["input_ids"], torch.long)[None],
        "targets": put(mb["targets"], torch.long)[None],
        "position_ids": put(mb["position_ids"], torch.long)[None],
        "select": put(mb["select"], torch.long),
        "attn": packed_attention_kwargs(mb["lengths"], device=DEVICE),
    }


def build(
    model_name: str,
    method: str,
    compile_layers: bool,
    fuse_lora: bool,
    lora_mode: str = "auto",
    gqa_mode: str = "repeat",
):
    # heavy: torch
    import torch

    # heavy: torch
    from llmft.trainer.fastpath import attention, lora

    # heavy: torch
    from llmft.trainer.fastpath import compile as fp_compile

    attention.register(gqa_mode)
    dtype = "bfloat16" if method == "lora" else "float32"
    model = common.build_model(model_name, attention.ATTENTION_NAME, dtype=dtype)
    if method == "lora":
        # heavy: peft
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
        if fuse_lora:
            skipped = lora.fuse_lora_linears(model, lora_mode)
            assert not skipped, skipped
    compile_s = 0.0
    if compile_layers:
        t0 = time.perf_counter()
        fp_compile.compile_decoder_layers(model)
        compile_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0, fused=(DEVICE == "cuda"))
    return model, params, opt, compile_s


def train_step(model, params, opt, micros_on_device, n_supervised: int, autocast: bool):
    # heavy: torch
    import torch

    # heavy: torch
    from llmft.trainer.fastpath.loss import fused_causal_lm_loss

    total = torch.zeros((), device=DEVICE)
    for b in micros_on_device:
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss_sum = fused_causal_lm_loss(
                model,
                b["input_ids"],
                b["targets"],
                reduction="sum",
                select=b["select"],
                position_ids=b["position_ids"],
                **b["attn"],
            )
        (loss_sum / n_supervised).backward()
        total += loss_sum.detach()
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=(DEVICE == "cuda"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total / n_supervised


def run(a) -> dict:
    # heavy: torch
    import torch

    model, params, opt, compile_call_s = build(
        a.model, a.method, not a.no_compile, not a.no_fuse_lora, lora_mode=a.lora_mode, gqa_mode=a.gqa_mode
    )
    samples = common.make_samples(a.samples_per_step * a.steps, a.profile, common.MODEL_SHAPES[a.model]["vocab_size"])
    plan = packed_micro_batches(samples, a.samples_per_step, a.micro, a.steps)
    shape = flops.shape_from_config(common.hf_config(a.model))
    timer = common.StepTimer()
    torch.cuda.reset_peak_memory_stats()
    timer.start()
    per_step_flops = []
    for micros in plan:
        on_device = [to_device(mb) for mb in micros]
        n_sup = sum(len(mb["select"]) for mb in micros)
        loss = train_step(model, params, opt, on_device, n_sup, autocast=(a.method == "full"))
        lengths = np.concatenate([mb["lengths"] for mb in micros])
        timer.step(int(lengths.sum()), n_sup, loss.item())
        per_step_flops.append(flops.step_flops(shape, a.method, lengths))
    result = {
        "arm": a.arm_name,
        "model": a.model,
        "method": a.method,
        "profile": a.profile,
        "attn": "llmft_varlen",
        "samples_per_step": a.samples_per_step,
        "micro_batch": a.micro,
        "compiled": not a.no_compile,
        "fused_lora": not a.no_fuse_lora,
        "lora_mode": a.lora_mode,
        "gqa_mode": a.gqa_mode,
        **common.device_info(),
    }
    result.update(common.summarize(timer, a.warmup, per_step_flops, flops.peak_flops(result["device"])))
    result["compile_s"] = result["warmup_s"] + compile_call_s
    result["step_times"] = timer.times
    common.write_json(a.json_out, result)
    if a.profile_steps:
        result["profile"] = profile(model, params, opt, plan[: a.profile_steps], a.method == "full")
        common.write_json(a.json_out, result)
    return result


def profile(model, params, opt, plan, autocast: bool) -> list[dict]:
    """Top CUDA kernels over a few steps (torch.profiler), printed and returned."""
    # heavy: torch
    import torch

    # heavy: torch
    from torch.profiler import ProfilerActivity

    # heavy: torch
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for micros in plan:
            on_device = [to_device(mb) for mb in micros]
            train_step(model, params, opt, on_device, sum(len(mb["select"]) for mb in micros), autocast)
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90), flush=True)
    rows = []
    for e in events:
        device_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if device_us:
            rows.append(
                {"name": e.key[:120], "self_device_ms": device_us / 1e3 / len(plan), "count": e.count // len(plan)}
            )
    rows.sort(key=lambda r: -r["self_device_ms"])
    return rows[:60]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    common.add_arm_arguments(p, "samples per packed micro-batch (accumulated to a step)")
    p.add_argument("--no-fuse-lora", action="store_true")
    p.add_argument("--arm-name", default="fastpath")
    p.add_argument("--profile-steps", type=int, default=0, help="after timing, profile this many steps")
    p.add_argument("--lora-mode", default="auto", help="fused LoRA form (trainer.fastpath.lora.LORA_MODES)")
    p.add_argument(
        "--gqa-mode", default="repeat", help="GQA into the varlen kernel (trainer.fastpath.attention.GQA_MODES)"
    )
    p.add_argument("--json-out", required=True)
    a = p.parse_args(argv)
    result = run(a)
    keys = ("arm", "model", "method", "tokens_per_s", "mfu", "peak_mem_gib", "compile_s", "step_s_p50", "first_losses")
    print({k: result.get(k) for k in keys})
    return 0


if __name__ == "__main__":
    sys.exit(main())
