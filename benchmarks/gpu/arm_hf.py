"""Arms (a) naive and (b) peer: the Hugging Face Trainer as people run it.

(a) naive: Trainer + PEFT LoRA (r 16, alpha 32, all linear), padding to the
    longest sample of each batch of 8, gradient checkpointing on, SDPA.
(b) peer: the best public setup available on the GPU machine: Trainer +
    DataCollatorWithFlattening (padding-free packing with per-document
    position ids) + Liger kernels (RMSNorm, RoPE, SwiGLU, fused linear
    cross-entropy) + flex attention (per-document masks), no checkpointing.

Both see the same samples in the same order (sequential sampler) with the
same samples per optimizer step as the project arm (naive: micro-batches of 8
with gradient accumulation), the same seeded random-init weights and LoRA
init, AdamW (fused), constant LR.

python -m llmft.benchmarks.gpu.arm_hf --arm naive|peer --model qwen2.5-1.5b --json-out F
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from llmft.benchmarks.gpu import common


def build_block_masks_eagerly() -> None:
    """Peer variant: transformers' packed-sequence flex block mask built without torch.compile.

    With ``_compile=True`` (transformers' choice) the first forward never finished: on torch 2.11 /
    transformers 5.17 Inductor spent 400+ s compiling one Triton kernel of the block-mask build for
    a ~15k-token packed row (benchmarks/NOTES.md, entry 16). Built eagerly, the mask costs one dense
    Q x KV pass per forward; flex attention itself stays compiled.
    """
    from transformers import masking_utils

    original = masking_utils.create_block_mask

    def create_block_mask(*args, **kwargs):
        kwargs["_compile"] = False
        return original(*args, **kwargs)

    masking_utils.create_block_mask = create_block_mask


def _lora(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _pad_collate(features):
    import torch

    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full((len(features), longest), common.IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.as_tensor(f["input_ids"])
        labels[i, :n] = torch.as_tensor(f["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class _Recorder:
    """TrainerCallback pieces: step wall times (synchronized) and logged losses."""

    def __init__(self, samples: common.Samples, per_step: int):
        self.timer = common.StepTimer()
        self.samples = samples
        self.per_step = per_step
        self.step_index = 0

    def callback(self):
        from transformers import TrainerCallback

        recorder = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                recorder.timer.start()

            def on_step_end(self, args, state, control, **kwargs):
                lo = recorder.step_index * recorder.per_step
                lengths = recorder.samples.lengths[lo : lo + recorder.per_step]
                labels = recorder.samples.labels[lo : lo + recorder.per_step]
                supervised = sum(int((common.supervised_targets(lab) != common.IGNORE_INDEX).sum()) for lab in labels)
                recorder.timer.step(int(lengths.sum()), supervised)
                recorder.step_index += 1
                print(f"[arm] step {recorder.step_index} {recorder.timer.times[-1]:.2f}s", flush=True)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    recorder.timer.losses.append(float(logs["loss"]))

        return Callback()


def _trainer(arm: str, model, dataset, per_step: int, steps: int, recorder: _Recorder, out_dir: str):
    import torch
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    micro = 8 if arm == "naive" else per_step
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        max_steps=steps,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch_fused",
        bf16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        gradient_checkpointing=(arm == "naive"),
        dataloader_num_workers=2,
        dataloader_pin_memory=True,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
    )
    if arm == "naive":
        args.gradient_checkpointing_kwargs = {"use_reentrant": False}
    collate = (
        _pad_collate if arm == "naive" else DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    )

    class SequentialTrainer(Trainer):
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return SequentialTrainer(
        model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[recorder.callback()]
    )


def run(
    arm: str,
    model_name: str,
    profile: str,
    per_step: int,
    steps: int,
    warmup: int,
    json_out: str,
    block_mask: str = "compiled",
) -> dict:
    import torch
    from llmft.trainer.fastpath import flops

    if arm == "peer" and block_mask == "eager":
        build_block_masks_eagerly()

    if arm == "peer":
        from liger_kernel.transformers import (
            apply_liger_kernel_to_llama,
            apply_liger_kernel_to_qwen2,
        )

        patch = (
            apply_liger_kernel_to_qwen2
            if common.MODEL_SHAPES[model_name]["arch"] == "qwen2"
            else apply_liger_kernel_to_llama
        )
        patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    attn = "sdpa" if arm == "naive" else "flex_attention"
    model = _lora(common.build_model(model_name, attn))
    samples = common.make_samples(per_step * steps, profile, common.MODEL_SHAPES[model_name]["vocab_size"])
    dataset = [
        {"input_ids": ids.tolist(), "labels": lab.tolist()}
        for ids, lab in zip(samples.input_ids, samples.labels, strict=True)
    ]
    recorder = _Recorder(samples, per_step)
    trainer = _trainer(arm, model, dataset, per_step, steps, recorder, f"/tmp/bench-{arm}")
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    shape = flops.shape_from_config(common.hf_config(model_name))
    per_step_flops = [
        flops.step_flops(shape, "lora", samples.lengths[i * per_step : (i + 1) * per_step]) for i in range(steps)
    ]
    result = {
        "arm": arm,
        "model": model_name,
        "method": "lora",
        "profile": profile,
        "attn": attn,
        "samples_per_step": per_step,
        "micro_batch": 8 if arm == "naive" else per_step,
        "gradient_checkpointing": arm == "naive",
        "block_mask": block_mask if arm == "peer" else None,
        **common.device_info(),
    }
    result.update(common.summarize(recorder.timer, warmup, per_step_flops, flops.peak_flops(result["device"])))
    result["compile_s"] = result["warmup_s"] if arm == "peer" else None
    common.write_json(json_out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arm", choices=["naive", "peer"], required=True)
    p.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(common.MODEL_SHAPES))
    p.add_argument("--profile", default="short", choices=sorted(common.PROFILES))
    p.add_argument("--samples-per-step", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--block-mask",
        choices=["compiled", "eager"],
        default="compiled",
        help="peer: build transformers' flex block mask compiled (its default) or eagerly",
    )
    p.add_argument("--json-out", required=True)
    a = p.parse_args(argv)
    result = run(a.arm, a.model, a.profile, a.samples_per_step, a.steps, a.warmup, a.json_out, a.block_mask)
    print({k: result[k] for k in ("arm", "model", "tokens_per_s", "mfu", "peak_mem_gib", "first_losses")})
    return 0


if __name__ == "__main__":
    import faulthandler
    import os

    if os.environ.get("BENCH_STACK_EVERY"):  # where a long first step spends its time (compile? eager flex?)
        faulthandler.dump_traceback_later(int(os.environ["BENCH_STACK_EVERY"]), repeat=True, file=sys.stderr)
    np.seterr(all="ignore")
    sys.exit(main())
