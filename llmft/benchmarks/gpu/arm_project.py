"""Arm (c) project: the project's own trainer (`python -m llmft.trainer`) on the benchmark's samples.

Writes the random-init model (same seed and init as the other arms) as a local
Hugging Face directory and the synthetic samples in llmft/trainer/data/shards.py's
format, ``--pack`` samples per stored sequence (the trainer concatenates
``--micro / --pack`` of them into one micro batch row), arranged so that the
trainer's seeded permutation visits them in the benchmark's order (same
samples per step, same step order as every arm; with several GPUs the trainer
deals a step's sequences to the ranks by token count). Then runs the trainer with the fast
path switched on by config and reads its metrics.jsonl: throughput is computed
here from the records' timestamps and the benchmark's own token counts, and
compared with what the trainer itself logged (tokens/s, MFU).

python -m llmft.benchmarks.gpu.arm_project --model qwen2.5-1.5b --method lora --json-out F
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llmft.benchmarks.gpu import common
from llmft.benchmarks.gpu.fp8_checkpoint import FP8_MODELS, write_fp8_model_dir
from llmft.trainer import flops
from llmft.trainer.command_line import override_pairs
from llmft.trainer.data.shards import write_split
from llmft.trainer.tiny_model import build_tokenizer

SEED = 42


def write_model_dir(model: str, root: Path) -> Path:
    """Random-init weights (seed 0, bf16, as the other arms build them) + a tokenizer, saved once; the 30B MoE
    shape in FP8 (fp8_checkpoint.py)."""
    out = root / model
    if (out / "config.json").is_file():
        return out
    if model in FP8_MODELS:  # the seeds' form; 61 GB in bf16 does not fit a one-GPU machine's disk
        return write_fp8_model_dir(model, root)
    # heavy: torch
    import torch

    # Built on the GPU (fast random init), saved from host memory: saving converts transformers' fused expert
    # tensors back to the checkpoint layout with copies, which the 30B MoE shape (61 GB) has no room for on an
    # 80 GB card (CUDA out of memory on an H100, 2026-11-27; the 141 GB H200 had the room).
    net = common.build_model(model, "sdpa", dtype="bfloat16").to("cpu")
    tmp = out.with_name(out.name + ".partial")
    net.save_pretrained(tmp, safe_serialization=True)
    build_tokenizer().save_pretrained(tmp)
    del net
    torch.cuda.empty_cache()
    tmp.rename(out)
    return out


def write_dataset(samples: common.Samples, pack: int, out: Path, val_docs: int = 32) -> Path:
    """Shards: sequence j of the benchmark's order sits where the trainer's permutation reads it."""

    n_seq = len(samples.lengths) // pack
    perm = np.random.default_rng([SEED, 0]).permutation(n_seq)
    order = np.empty(n_seq, dtype=np.int64)
    order[perm] = np.arange(n_seq)  # slot perm[j] holds benchmark sequence j; order[slot] = sequence
    docs = [i for j in order for i in range(j * pack, (j + 1) * pack)]
    _write(out / "train", [samples.input_ids[i] for i in docs], [samples.labels[i] for i in docs], pack, write_split)
    val = common.make_samples(val_docs, "short", int(samples.input_ids[0].max()) + 1, seed=99)
    _write(out / "val", val.input_ids, val.labels, 8, write_split)
    longest = max(int(samples.lengths[j * pack : (j + 1) * pack].sum()) for j in range(n_seq))
    return common.write_data_manifest(out, longest, "synthetic benchmark data (llmft/benchmarks/gpu/arm_project.py)")


def _write(directory: Path, ids, labels, per_seq: int, write_split) -> None:
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    doc_offsets = np.concatenate([[0], np.cumsum(lengths)])
    seq_offsets = np.arange(0, len(ids) + 1, per_seq, dtype=np.int64)
    write_split(directory, np.concatenate(ids), np.concatenate(labels), doc_offsets, seq_offsets)


def trainer_command(a, model_dir: Path, data_dir: Path, out_dir: Path) -> list[str]:
    overrides = [
        f"model.name_or_path={model_dir}",
        f"data={data_dir}",
        f"output_dir={out_dir}",
        f"method={a.method}",
        "model.attn_implementation=llmft_varlen",
        "lora.r=16",
        "lora.alpha=32",
        "lora.dropout=0.0",
        "optim.lr=2e-4",
        "schedule.decay=constant",
        "schedule.warmup_steps=0",
        f"batch.global_sequences={a.nproc * a.samples_per_step // a.pack}",
        f"batch.micro_sequences={a.micro // a.pack}",
        f"max_steps={a.steps}",
        f"log_every={a.log_every}",
        "eval_every=0",
        "save_every=0",
        "eval.max_sequences=4",
        "kernels.fused_loss=true",
        *(["kernels.fused_lora=true"] if a.method == "lora" else []),  # true where it cannot apply is an error
        f"kernels.compile={'false' if a.no_compile else 'true'}",
        "model.gradient_checkpointing=false",  # the tuned arm: the harness sizes the micro batch, no recompute
        "observe.progress_bar=false",
        f"seed={SEED}",
        *a.override,
    ]
    if a.nproc > 1 or a.torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}"]
        return [*launcher, "-m", "llmft.benchmarks.gpu.trainer_entry", *overrides]
    return [sys.executable, "-m", "llmft.benchmarks.gpu.trainer_entry", *overrides]


def summarize_metrics(metrics_path: Path, samples: common.Samples, a, shape) -> dict:
    """Throughput from the trainer's record timestamps and our own token counts; vs its own log.

    Each train record closes a window of steps (log_every). Timing starts at the first
    record at or after step ``--warmup`` (compile and warm-up stay out of it).
    """

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("event") == "train"]
    per = a.samples_per_step * a.nproc

    def step_slice(step):
        return slice((step - 1) * per, step * per)

    bounds = [0] + [r["step"] for r in train]
    windows = [range(lo + 1, hi + 1) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    tokens = [sum(int(samples.lengths[step_slice(s)].sum()) for s in w) for w in windows]
    wflops = [sum(flops.step_flops(shape, a.method, samples.lengths[step_slice(s)]) for s in w) for w in windows]
    supervised = [
        sum(
            int((common.supervised_targets(lab) != common.IGNORE_INDEX).sum())
            for s in w
            for lab in samples.labels[step_slice(s)]
        )
        for w in windows
    ]
    first = next(i for i, r in enumerate(train) if r["step"] >= a.warmup)
    timed = range(first + 1, len(train))
    span = train[-1]["time"] - train[first]["time"]
    bench_tps = sum(tokens[i] for i in timed) / span
    logged_tps = sum(tokens[i] for i in timed) / sum(tokens[i] / train[i]["tokens_per_s"] for i in timed)
    peak = flops.peak_flops(common.device_info()["device"])
    bench_mfu = flops.mfu(sum(wflops[i] for i in timed), span, peak and peak * a.nproc)
    # The trainer's own window times (its tokens / its tokens/s) weight its per-window MFU.
    logged_dt = [tokens[i] / train[i]["tokens_per_s"] for i in timed]
    logged_mfu = (
        sum(train[i]["mfu"] * dt for i, dt in zip(timed, logged_dt, strict=True)) / sum(logged_dt)
        if "mfu" in train[-1]
        else None
    )
    step_s = [(train[i]["time"] - train[i - 1]["time"]) / len(windows[i]) for i in timed]
    return {
        "tokens_per_s": bench_tps,
        "tokens_per_s_per_gpu": bench_tps / a.nproc,
        "supervised_tokens_per_s": sum(supervised[i] for i in timed) / span,
        "mfu": bench_mfu,
        "trainer_logged_tokens_per_s": logged_tps,
        "trainer_logged_mfu": logged_mfu,
        "logged_vs_bench_tokens_per_s": logged_tps / bench_tps - 1,
        "logged_vs_bench_mfu": (logged_mfu / bench_mfu - 1) if (logged_mfu and bench_mfu) else None,
        "step_s_p50": float(np.percentile(step_s, 50)),
        "step_s_p90": float(np.percentile(step_s, 90)),
        "peak_mem_gib": max(r.get("peak_mem_gib", 0) for r in train),
        "reserved_mem_gib": max(r.get("peak_reserved_gib", 0) for r in train),
        "first_losses": [r["loss"] for r in train[:5]],
        "fast_path": next((r.get("fast_path") for r in records if r.get("event") == "fast_path"), None),
        "steps_timed": sum(len(windows[i]) for i in timed),
        "tokens_per_step_mean": float(np.mean([t / len(w) for t, w in zip(tokens, windows, strict=True)])),
    }


def run(a) -> dict:
    root = Path(a.work)
    vocab = common.MODEL_SHAPES[a.model]["vocab_size"]
    samples = common.make_samples(a.samples_per_step * a.nproc * a.steps, a.profile, vocab)
    model_dir = write_model_dir(a.model, root / "models")
    if a.micro % a.pack or a.samples_per_step % a.micro:
        raise SystemExit(
            f"--micro {a.micro} must divide --samples-per-step {a.samples_per_step} and be a multiple of --pack "
            f"{a.pack}"
        )
    data_dir = write_dataset(
        samples, a.pack, root / "data" / f"{a.model}-{a.profile}-{a.samples_per_step * a.nproc}-{a.pack}-{a.steps}"
    )
    out_dir = root / "runs" / f"{a.model}-{a.method}-{a.nproc}gpu-{int(time.time())}"
    cmd = trainer_command(a, model_dir, data_dir, out_dir)
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", BENCH_SKIP_SAVES="0" if a.keep_saves else "1")
    log_copy = Path(a.json_out).with_suffix(".trainer.log")  # streamed: an arm cut by its timeout keeps its log
    with open(log_copy, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, env=env, text=True, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    output = log_copy.read_text()
    print(output[-20000:], flush=True)
    metrics_path = out_dir / "metrics.jsonl"
    if metrics_path.is_file():
        Path(a.json_out).with_suffix(".metrics.jsonl").write_text(metrics_path.read_text())
    result = {
        "arm": a.arm_name,
        "model": a.model,
        "method": a.method,
        "profile": a.profile,
        "attn": "llmft_varlen",
        "samples_per_step": a.samples_per_step * a.nproc,
        "micro_batch": a.micro,
        "pack": a.pack,
        "gpus": a.nproc,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True (trainer default)"),
        "trainer_overrides": a.override,
        "steps": a.steps,
        "trainer_returncode": proc.returncode,
        "trainer_wall_s": wall,
        **common.device_info(),
    }
    if proc.returncode == 0 and metrics_path.is_file():
        shape = flops.shape_from_config(common.hf_config(a.model))
        result.update(summarize_metrics(metrics_path, samples, a, shape))
        dropout = next((float(v) for k, v in reversed(override_pairs(a.override)) if k == "lora.dropout"), 0.0)
        result["kernel_path"] = common.kernel_path(result.get("fast_path"), dropout if a.method != "full" else None)
        first_step = next(json.loads(line) for line in metrics_path.read_text().splitlines() if '"train"' in line)
        result["compile_s"] = _first_step_seconds(output, first_step)
    common.write_json(a.json_out, result)
    if not a.keep_saves:
        common.remove_run_dir(out_dir)
    return result


def _first_step_seconds(stdout: str, first_record: dict):
    """Seconds from the model being loaded to the first step record (compile + first step)."""
    for line in stdout.splitlines():
        if line.startswith("[trainer_entry] loaded="):
            return first_record["time"] - float(line.split("=", 1)[1])
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    common.add_arm_arguments(p, "samples per micro batch (one packed row)")
    p.add_argument("--pack", type=int, default=8, help="samples per stored sequence (the unit dealt to ranks)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) through torchrun; --samples-per-step is per GPU")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--torchrun", action="store_true", help="launch through torchrun even for one rank")
    p.add_argument("--arm-name", default="project")
    p.add_argument("--work", default="/tmp/llmft-project")
    p.add_argument("--override", action="append", default=[], help="extra trainer key=value")
    p.add_argument(
        "--keep-saves",
        action="store_true",
        help="let the trainer write checkpoints and final/, and keep the run folder",
    )
    p.add_argument("--json-out", required=True)
    a = p.parse_args(argv)
    result = run(a)
    keys = (
        "arm",
        "model",
        "method",
        "tokens_per_s",
        "trainer_logged_tokens_per_s",
        "mfu",
        "peak_mem_gib",
        "first_losses",
    )
    print({k: result.get(k) for k in keys})
    return 0 if result.get("tokens_per_s") else 1


if __name__ == "__main__":
    sys.exit(main())
