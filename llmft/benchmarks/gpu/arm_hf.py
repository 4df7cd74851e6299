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
from pathlib import Path

import numpy as np

from llmft.benchmarks.gpu import common
from llmft.benchmarks.gpu.arm_project import write_model_dir
from llmft.trainer import flops


def build_block_masks_eagerly() -> None:
    """Peer variant: transformers' packed-sequence flex block mask built without torch.compile.

    With ``_compile=True`` (transformers' choice) the first forward never finished: on torch 2.11 /
    transformers 5.17 Inductor spent 400+ s compiling one Triton kernel of the block-mask build for
    a ~15k-token packed row (benchmarks/NOTES.md). Built eagerly, the mask costs one dense
    Q x KV pass per forward; flex attention itself stays compiled.
    """
    # heavy: transformers
    from transformers import masking_utils

    original = masking_utils.create_block_mask

    def create_block_mask(*args, **kwargs):
        kwargs["_compile"] = False
        return original(*args, **kwargs)

    masking_utils.create_block_mask = create_block_mask


def _lora(model):
    # heavy: peft
    from peft import LoraConfig, get_peft_model

    # On transformers-5 MoE models PEFT turns "all-linear" into the router and both expert tensors;
    # the project's all-linear there is the attention projections, so the peer adapts the same modules.
    moe = getattr(model.config, "num_experts", 0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if moe else "all-linear"
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _qlora_base(model_name: str, attn: str, work: str):
    """QLoRA as people run it: HF + bitsandbytes NF4 (double quant, bf16 compute) from the same
    random-init checkpoint the project arm trains, then PEFT's prepare_model_for_kbit_training."""

    # heavy: torch
    import torch

    # heavy: peft
    from peft import prepare_model_for_kbit_training

    # heavy: transformers
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = write_model_dir(model_name, Path(work) / "models")
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    net = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=torch.bfloat16, attn_implementation=attn, device_map={"": 0}
    )
    return prepare_model_for_kbit_training(net, use_gradient_checkpointing=False)


def _liger(model_name: str) -> str:
    """Liger's patch for the shape's family; SwiGLU off for MoE (transformers 5 fuses the experts)."""
    # heavy: liger_kernel
    from liger_kernel import transformers as liger

    arch = common.MODEL_SHAPES[model_name]["arch"]
    kwargs = dict(rope=True, rms_norm=True, swiglu=arch != "qwen3_moe", cross_entropy=False)
    patch = getattr(liger, f"apply_liger_kernel_to_{arch}")  # qwen2, llama, qwen3_moe
    try:
        patch(fused_linear_cross_entropy=True, **kwargs)
    except (AttributeError, ImportError, TypeError) as exc:  # liger's MoE patch and transformers 5: unchecked
        if arch != "qwen3_moe":
            raise
        return f"none ({type(exc).__name__}: {exc})"
    return patch.__name__


def _pad_collate(features):
    # heavy: torch
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
        # heavy: transformers
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


def _trainer(arm: str, model, dataset, per_step: int, steps: int, recorder: _Recorder, out_dir: str, micro: int = 0):
    # heavy: torch
    import torch

    # heavy: transformers
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    micro = 8 if arm == "naive" else (micro or per_step)
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
    method: str = "lora",
    micro: int = 0,
    work: str = "/tmp/llmft-project",
) -> dict:
    # heavy: torch
    import torch

    if arm == "peer" and block_mask == "eager":
        build_block_masks_eagerly()
    liger = _liger(model_name) if arm == "peer" else None
    attn = "sdpa" if arm == "naive" else "flex_attention"
    base = _qlora_base(model_name, attn, work) if method == "qlora" else common.build_model(model_name, attn)
    model = _lora(base)
    samples = common.make_samples(per_step * steps, profile, common.MODEL_SHAPES[model_name]["vocab_size"])
    dataset = [
        {"input_ids": ids.tolist(), "labels": lab.tolist()}
        for ids, lab in zip(samples.input_ids, samples.labels, strict=True)
    ]
    recorder = _Recorder(samples, per_step)
    trainer = _trainer(arm, model, dataset, per_step, steps, recorder, f"/tmp/bench-{arm}", micro)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    shape = flops.shape_from_config(common.hf_config(model_name))
    per_step_flops = [
        flops.step_flops(shape, method, samples.lengths[i * per_step : (i + 1) * per_step]) for i in range(steps)
    ]
    result = {
        "arm": arm,
        "model": model_name,
        "method": method,
        "liger": liger,
        "profile": profile,
        "attn": attn,
        "samples_per_step": per_step,
        "micro_batch": 8 if arm == "naive" else (micro or per_step),
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
    p.add_argument("--method", default="lora", choices=["lora", "qlora"], help="qlora: bitsandbytes NF4 base")
    p.add_argument("--micro", type=int, default=0, help="peer: samples per forward (0 = all of the step)")
    p.add_argument("--work", default="/tmp/llmft-project", help="qlora: where the shared checkpoint is written")
    p.add_argument("--json-out", required=True)
    a = p.parse_args(argv)
    result = run(
        a.arm,
        a.model,
        a.profile,
        a.samples_per_step,
        a.steps,
        a.warmup,
        a.json_out,
        a.block_mask,
        method=a.method,
        micro=a.micro,
        work=a.work,
    )
    print({k: result[k] for k in ("arm", "model", "tokens_per_s", "mfu", "peak_mem_gib", "first_losses")})
    return 0


if __name__ == "__main__":
    import faulthandler
    import os

    if os.environ.get("BENCH_STACK_EVERY"):  # where a long first step spends its time (compile? eager flex?)
        faulthandler.dump_traceback_later(int(os.environ["BENCH_STACK_EVERY"]), repeat=True, file=sys.stderr)
    np.seterr(all="ignore")
    sys.exit(main())
