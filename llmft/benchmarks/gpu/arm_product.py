"""Arm project-product: what a user runs, measured.

``llmft train --config <shipped config>`` with only the model, the data, the step count and the
output folder set (:data:`PRODUCT_KEYS`): no kernel, batch or attention override, so every speed
decision is the shipped config's and the trainer's own (``auto``: llmft/trainer/fastpath/resolve.py and
memory.py). Beside it the tuned ``project`` arm (arm_project.py: the fast path forced on by
overrides, the micro batch sized by the harness) shows what the product leaves on the table.

The data are the benchmark's seeded synthetic samples (common.make_samples, same profile), packed
into sequences of the config's ``max_length`` the way ``llmft data tokenize --pack`` packs
(trainer.data.packing.best_fit_pack), so the trainer's loader, micro batch and memory plan see
what they would see on real data. Throughput comes from the trainer's metrics.jsonl train records
(timestamps) and this arm's own token count of the steps between them (the trainer's loader
over the same shards), after ``--warmup`` steps; MFU from the same FLOP formula the trainer logs
(trainer.flops over the documents' lengths). Both are compared with what the trainer
reported itself (its logged windows and its steady-state summary).

python -m llmft.benchmarks.gpu.arm_product --model qwen2.5-1.5b --method lora --json-out F
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llmft.benchmarks.gpu import common
from llmft.benchmarks.gpu.arm_project import write_model_dir
from llmft.trainer import flops
from llmft.trainer.config_load import load_config
from llmft.trainer.data.loader import PackedLoader, resolve_global_sequences
from llmft.trainer.data.packing import best_fit_pack
from llmft.trainer.data.shards import write_split

REPO = Path(__file__).resolve().parents[3]  # llmft/benchmarks/gpu/ -> the checkout
PRODUCT_CONFIGS: dict[tuple[str, str], tuple[str, int]] = {
    # (benchmark shape, method): (shipped config, the max_length its header says to pack the data to)
    ("qwen2.5-1.5b", "lora"): ("trainer/configs/qwen2.5-1.5b-lora-1xh100.yaml", 2048),
    ("qwen2.5-0.5b", "lora"): ("trainer/configs/qwen2.5-1.5b-lora-1xh100.yaml", 2048),
    ("llama-3-8b", "lora"): ("trainer/configs/qwen2.5-7b-lora-1xh100.yaml", 4096),
    ("qwen2.5-1.5b", "full"): ("trainer/configs/qwen2.5-1.5b-full-1xh100.yaml", 2048),
    ("qwen3-30b-a3b", "qlora"): ("trainer/configs/qwen3-30b-a3b-qlora-1xh100.yaml", 4096),
    ("llama-3-8b", "full"): ("trainer/configs/llama-3-8b-full-zero3-4xh100.yaml", 4096),
}
PRODUCT_KEYS = ("model.name_or_path", "data", "max_steps", "output_dir")
"""The only settings this arm passes; everything else is the shipped config's."""


def product_command(
    config: str | Path,
    model_dir: Path,
    data_dir: Path,
    out_dir: Path,
    steps: int,
    nproc: int = 1,
    saves: bool = True,
    wrapped: bool = False,
) -> list[str]:
    """``llmft train [--nproc N] --config <shipped config>`` plus exactly :data:`PRODUCT_KEYS` (``--nproc`` is
    the launcher's flag, not a setting: the config's global batch is split over the ranks).

    ``saves=False`` (full fine-tuning): the same trainer entry point with the same arguments through the
    benchmark's wrapper (trainer_entry.py, ``BENCH_SKIP_SAVES=1``), which writes no checkpoint and no
    ``final/``: an 8B ZeRO-3 checkpoint with its optimizer state is over 100 GB, more than the device's disk.
    ``wrapped``: through the same wrapper with saves as asked (a profiled or step-marked run, trainer_entry.py)."""
    values = (model_dir, data_dir, steps, out_dir)
    overrides = [f"{key}={value}" for key, value in zip(PRODUCT_KEYS, values, strict=True)]
    if not saves or wrapped:
        entry = ["-m", "llmft.benchmarks.gpu.trainer_entry", "--config", str(config), *overrides]
        if nproc > 1:
            launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]  # llmft train's
            return [sys.executable, *launcher, *entry]
        return [sys.executable, *entry]
    launch = ["--nproc", str(nproc)] if nproc > 1 else []
    return [sys.executable, "-m", "llmft", "train", *launch, "--config", str(config), *overrides]


def product_config(model: str, method: str) -> tuple[Path, int]:
    """(path of the shipped config, data max_length) for a benchmark row."""
    try:
        relative, max_length = PRODUCT_CONFIGS[(model, method)]
    except KeyError:
        raise SystemExit(f"no shipped config for {model} {method}; rows: {sorted(PRODUCT_CONFIGS)}") from None
    return REPO / relative, max_length


def samples_for(steps: int, global_sequences: int, max_length: int, profile: str, vocab: int) -> common.Samples:
    """Enough seeded samples to fill ``steps`` steps of ``global_sequences`` packed sequences."""
    spec = common.PROFILES[profile]
    mean = spec["median"] * math.exp(spec["sigma"] ** 2 / 2)
    count = int(1.15 * steps * global_sequences * max_length / mean) + 64
    return common.make_samples(count, profile, vocab)


def write_product_dataset(samples: common.Samples, max_length: int, out: Path, val_docs: int = 32) -> Path:
    """Shards as ``llmft data tokenize --pack --max-length max_length`` writes them: longer documents
    dropped (its default ``--truncation drop``), the rest best-fit packed."""

    if (out / "manifest.json").is_file():
        return out
    val = common.make_samples(val_docs, "short", int(samples.input_ids[0].max()) + 1, seed=99)
    for split, data in (("train", samples), ("val", val)):
        kept = np.flatnonzero(data.lengths <= max_length)  # tokenize's default --truncation drop
        packed = [[int(kept[i]) for i in seq] for seq in best_fit_pack(data.lengths[kept], max_length)]
        order = [d for seq in packed for d in seq]
        ids = [data.input_ids[d] for d in order]
        labels = [data.labels[d] for d in order]
        doc_offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])])
        seq_offsets = np.concatenate([[0], np.cumsum([len(s) for s in packed])])
        write_split(out / split, np.concatenate(ids), np.concatenate(labels), doc_offsets, seq_offsets)
    return common.write_data_manifest(
        out,
        max_length,
        "synthetic benchmark data packed like `llmft data tokenize --pack` (llmft/benchmarks/gpu/arm_product.py)",
    )


def step_documents(data_dir: Path, cfg, steps: int) -> dict[int, np.ndarray]:
    """Document lengths of every step 1..steps, as the trainer's loader deals them (one rank)."""

    manifest = json.loads((data_dir / "manifest.json").read_text())
    sequences = resolve_global_sequences(
        cfg.batch.global_sequences, cfg.batch.global_tokens, int(manifest["max_length"])
    )
    loader = PackedLoader(
        data_dir, "train", global_sequences=sequences, micro_sequences=sequences, rank=0, world_size=1, seed=cfg.seed
    )
    try:
        return {s: np.concatenate([m.doc_lengths for m in loader.batch(s).micro_batches]) for s in range(1, steps + 1)}
    finally:
        loader.close()


def summarize(
    metrics_path: Path, docs: dict[int, np.ndarray], shape, method: str, warmup: int, peak, marks: Path | None = None
) -> dict:
    """Throughput between the first train record at or after ``warmup`` and the last one; ``peak`` is the
    FLOP/s of every GPU of the run together (MFU per GPU). With step ``marks`` (trainer_entry.py
    ``BENCH_STEP_MARKS``: the synchronized end of step s - 1, taken as a record of step s - 1) the window may
    start at the mark of step ``warmup + 1`` when the config logs too rarely for two records after it."""

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("event") == "train"]
    timed = [r for r in train if r["step"] >= warmup]
    if marks is not None and marks.is_file() and not any(r["step"] == warmup for r in train):
        marked = [json.loads(line) for line in marks.read_text().splitlines() if line.strip()]
        timed = [{"step": warmup, "time": m["time"], "mark": True} for m in marked if m["step"] == warmup + 1] + timed
    if len(timed) < 2:
        return {"error": f"too few train records after step {warmup} to time ({[r['step'] for r in train]})"}
    first, last = timed[0], timed[-1]
    span = last["time"] - first["time"]
    steps = range(first["step"] + 1, last["step"] + 1)
    tokens = sum(int(docs[s].sum()) for s in steps)
    work = sum(flops.step_flops(shape, method, docs[s]) for s in steps)
    final = next((r for r in records if r.get("event") == "final"), {})
    fast_path = next((r.get("fast_path") for r in records if r.get("event") == "fast_path"), None)
    step_s = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(timed, timed[1:], strict=False)]
    bench_tps = tokens / span
    logged_tps = final.get("tokens_per_s")
    return {
        "tokens_per_s": bench_tps,
        "mfu": flops.mfu(work, span, peak),
        "steps_timed": len(steps),
        "tokens_per_step_mean": tokens / len(steps),
        "step_s_p50": float(np.percentile(step_s, 50)),
        "trainer_logged_tokens_per_s": logged_tps,
        "trainer_logged_mfu": final.get("mfu"),
        "logged_vs_bench_tokens_per_s": logged_tps / bench_tps - 1 if logged_tps else None,
        "peak_mem_gib": max(r.get("peak_mem_gib", 0) for r in train),
        "reserved_mem_gib": max(r.get("peak_reserved_gib", 0) for r in train),
        "window": [first["step"], last["step"], "mark" if "mark" in first else "record"],
        "first_losses": [r["loss"] for r in train[:5]],
        "compile_s": final.get("warmup_s"),
        "load_s": final.get("load_s"),
        "load_peak_gib": final.get("load_peak_gib"),
        "fast_path": fast_path,
    }


def profile_summary(log: Path) -> dict | None:
    """The ``[profile-json]`` line a profiled run printed (trainer_entry.py report_profile), else None."""
    lines = [line for line in log.read_text().splitlines() if line.startswith("[profile-json] ")]
    return json.loads(lines[-1].removeprefix("[profile-json] ")) if lines else None


def run(a) -> dict:
    root = Path(a.work)
    config, max_length = product_config(a.model, a.method)
    cfg = load_config(str(config), [f"max_steps={a.steps}"])
    vocab = common.MODEL_SHAPES[a.model]["vocab_size"]
    samples = samples_for(a.steps, cfg.batch.global_sequences, max_length, a.profile, vocab)
    model_dir = write_model_dir(a.model, root / "models")
    data_dir = write_product_dataset(
        samples, max_length, root / "data" / f"product-{a.model}-{a.profile}-{max_length}-{len(samples.lengths)}"
    )
    out_dir = root / "runs" / f"product-{a.model}-{a.method}-{int(time.time())}"
    saves = a.method != "full"  # full fine-tuning arms write no checkpoints (product_command)
    wrapped = bool(a.profile_step or a.marks)
    cmd = product_command(
        config.relative_to(REPO), model_dir, data_dir, out_dir, a.steps, a.nproc, saves=saves, wrapped=wrapped
    )
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", BENCH_SKIP_SAVES="0" if saves else "1")
    marks = Path(a.json_out).with_suffix(".marks.jsonl") if a.marks else None
    if marks is not None:
        marks.unlink(missing_ok=True)
        env["BENCH_STEP_MARKS"] = str(marks)
    if a.profile_step:
        env.update(BENCH_PROFILE_STEPS=f"{a.profile_step}:{a.profile_step}", BENCH_PROFILE_TRACE="0")
    log_copy = Path(a.json_out).with_suffix(".trainer.log")  # streamed: an arm cut by its timeout keeps its log
    with open(log_copy, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    print(log_copy.read_text()[-20000:], flush=True)
    metrics_path = out_dir / "metrics.jsonl"
    if metrics_path.is_file():
        Path(a.json_out).with_suffix(".metrics.jsonl").write_text(metrics_path.read_text())
    result = {
        "arm": a.arm_name,
        "model": a.model,
        "method": a.method,
        "profile": a.profile,
        "config": str(config.relative_to(REPO)),
        "command": cmd,
        "data_max_length": max_length,
        "samples_per_step": None,
        "gpus": a.nproc,
        "steps": a.steps,
        "trainer_returncode": proc.returncode,
        "trainer_wall_s": wall,
        **common.device_info(),
    }
    if proc.returncode == 0 and metrics_path.is_file():
        shape = flops.shape_from_config(common.hf_config(a.model))
        docs = step_documents(data_dir, cfg, a.steps)
        peak = flops.peak_flops(result["device"])
        result.update(summarize(metrics_path, docs, shape, a.method, a.warmup, peak and peak * a.nproc, marks))
        result["profile"] = profile_summary(log_copy)
        if result.get("tokens_per_s"):
            result["tokens_per_s_per_gpu"] = result["tokens_per_s"] / a.nproc
        dropout = cfg.lora.dropout if a.method != "full" else None
        result["kernel_path"] = common.kernel_path(result.get("fast_path"), dropout)
    common.write_json(a.json_out, result)
    common.remove_run_dir(out_dir)  # the real CLI wrote its checkpoint and final/: measured, not kept
    return result


def from_saved_metrics(a) -> dict:
    """The row of a run whose trainer finished but whose arm was cut by the harness's deadline before it wrote
    its JSON: the same :func:`summarize` over the metrics.jsonl (and step marks) the arm had copied beside its
    log, with the loader's tokens of the same seeded data (rebuilt here, deterministic)."""
    config, max_length = product_config(a.model, a.method)
    cfg = load_config(str(config), [f"max_steps={a.steps}"])
    vocab = common.MODEL_SHAPES[a.model]["vocab_size"]
    samples = samples_for(a.steps, cfg.batch.global_sequences, max_length, a.profile, vocab)
    data_dir = write_product_dataset(
        samples,
        max_length,
        Path(a.work) / "data" / f"product-{a.model}-{a.profile}-{max_length}-{len(samples.lengths)}",
    )
    docs = step_documents(data_dir, cfg, a.steps)
    metrics = Path(a.from_metrics)
    marks = metrics.with_name(metrics.name.replace(".metrics.jsonl", ".marks.jsonl"))
    shape = flops.shape_from_config(common.hf_config(a.model))
    result = {"arm": a.arm_name, "model": a.model, "method": a.method, "config": str(config.relative_to(REPO))}
    result.update(summarize(metrics, docs, shape, a.method, a.warmup, flops.PEAK_BF16_FLOPS["H200"], marks))
    result["recomputed_from"] = metrics.name
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(common.MODEL_SHAPES))
    p.add_argument("--method", default="lora", choices=["lora", "qlora", "full"])
    p.add_argument("--profile", default="short", choices=sorted(common.PROFILES))
    p.add_argument("--steps", type=int, default=30, help="max_steps (the shipped config logs every 10)")
    p.add_argument("--warmup", type=int, default=10, help="time from the first train record at or after this step")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (llmft train --nproc); the global batch is the config's")
    p.add_argument("--profile-step", type=int, default=0, help="torch.profiler over this step (trainer_entry.py)")
    p.add_argument("--marks", action="store_true", help="synchronized step marks: time from step --warmup + 1 on")
    p.add_argument("--arm-name", default="project-product")
    p.add_argument("--work", default="/tmp/llmft-project", help="shared with the project arm (model checkpoints)")
    p.add_argument("--json-out", required=True)
    p.add_argument("--from-metrics", default="", help="recompute a cut arm's row from its saved metrics.jsonl (H200)")
    a = p.parse_args(argv)
    result = from_saved_metrics(a) if a.from_metrics else run(a)
    if a.from_metrics:
        common.write_json(a.json_out, result)
    keys = ("arm", "model", "method", "config", "tokens_per_s", "trainer_logged_tokens_per_s", "mfu", "peak_mem_gib")
    print({k: result.get(k) for k in keys})
    return 0 if result.get("tokens_per_s") else 1


if __name__ == "__main__":
    sys.exit(main())
