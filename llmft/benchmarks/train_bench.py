"""`llmft bench train`: training throughput arms side by side on one GPU.

Arms, each in its own process (clean memory, one failure never hides the rest):
  naive    HF Trainer + PEFT LoRA, padded batches of 8, gradient checkpointing
  peer     HF Trainer + padding-free packing + Liger kernels + flex attention
           (peer-eagermask, the default: the same with transformers' flex block mask built
           uncompiled; compiled, its first forward did not finish in 530 s on torch 2.11)
  fastpath llmft/trainer/fastpath alone in a minimal loop (llmft/benchmarks/gpu/arm_fast.py)
  project  the project's trainer itself (`python -m llmft.trainer`, llmft/benchmarks/gpu/arm_project.py),
           the fast path forced on by overrides, the micro batch sized by the harness ("tuned")
  project-product
           what a user runs: `llmft train --config <shipped config>` with only the model, data,
           step count and output folder set (llmft/benchmarks/gpu/arm_product.py)
plus the 8192^3 bf16 matmul calibration and kernel checks (llmft/benchmarks/gpu/check_kernels.py).

Every arm sees the same seeded synthetic samples in the same order, the same
samples per optimizer step, the same random-init weights. Results: one JSON
(``<date>-<device>.json``: device, date, versions, matmul_tflops, arms) and a
Markdown table beside it, written atomically into ``--out`` (default ``benchmarks/results``
under the current directory: ``llmft.benchmarks.RESULTS_DIR``). This module imports only the
standard library and ``llmft.trainer.io`` (itself stdlib only) at module level (the CLI imports
it on machines without a GPU).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmft.benchmarks import RESULTS_DIR
from llmft.trainer.io import atomic_write_text

DEFAULT_MICRO = {  # samples per packed micro-batch (64 per optimizer step), sized to fit 80 GB without recompute
    ("qwen2.5-0.5b", "lora"): 64,
    ("qwen2.5-1.5b", "lora"): 64,
    ("llama-3-8b", "lora"): 32,
    ("qwen2.5-0.5b", "full"): 64,
    ("qwen2.5-1.5b", "full"): 32,
    ("llama-3-8b", "full"): 8,
    # QLoRA rows and the MoE shape (top-8 of 128 experts: eight expert rows per token)
    ("qwen2.5-1.5b", "qlora"): 16,
    ("llama-3-8b", "qlora"): 16,
    ("qwen3-30b-a3b", "lora"): 32,
    ("qwen3-30b-a3b", "qlora"): 16,
    ("qwen3-30b-a3b-4layers", "lora"): 64,
    ("qwen3-30b-a3b-4layers", "qlora"): 64,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jobs",
        default="check,naive:qwen2.5-1.5b:lora,peer-eagermask:qwen2.5-1.5b:lora,project:qwen2.5-1.5b:lora",
        help="comma list of 'check' and ARM:MODEL:METHOD (ARM naive|peer|peer-eagermask|fastpath|project|"
        "project-product; "
        "plain 'peer' keeps transformers' compiled flex block mask, which compiled for 400+ s "
        "on torch 2.11 without finishing)",
    )
    parser.add_argument("--profile", default="short", choices=["short", "long"])
    parser.add_argument("--samples-per-step", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps for packed arms")
    parser.add_argument("--naive-steps", type=int, default=6, help="optimizer steps for the naive arm")
    parser.add_argument("--warmup", type=int, default=4, help="steps excluded from throughput (compile, warm-up)")
    parser.add_argument(
        "--out", default=str(RESULTS_DIR), help=f"folder for <date>-<device>.json/.md (default: {RESULTS_DIR})"
    )
    parser.add_argument("--work", default="/tmp/llmft-bench", help="scratch folder (per-arm JSON and logs)")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="stop starting arms after this many seconds")
    parser.add_argument("--arm-timeout-s", type=float, default=420.0, help="kill one arm after this many seconds")
    parser.add_argument("--extra", default="", help="extra arguments passed to every packed arm (space-separated)")
    parser.add_argument(
        "--product-extra",
        default="",
        help="arguments for the product arm's harness, not the trainer (e.g. '--marks --profile-step 3': "
        "arm_product.py)",
    )
    parser.add_argument("--label", default="", help="tag stored on every arm of this invocation (e.g. 2gpu-zero3)")
    parser.add_argument("--merge-from", default="", help="also merge the arms of the result JSON files in this folder")


def _job_command(job: str, args, json_out: Path) -> list[str]:
    py = sys.executable
    if job == "check":
        return [py, "-m", "llmft.benchmarks.gpu.check_kernels", "--json-out", str(json_out)]
    arm, model, method = job.split(":")
    common = [
        "--model",
        model,
        "--profile",
        args.profile,
        "--samples-per-step",
        str(args.samples_per_step),
        "--json-out",
        str(json_out),
    ]
    if arm in ("naive", "peer", "peer-eagermask"):
        steps = args.naive_steps if arm == "naive" else args.steps
        warmup = 2 if arm == "naive" else args.warmup
        mask = ["--block-mask", "eager"] if arm == "peer-eagermask" else []
        if arm != "naive":  # the peer takes the project arm's method and micro batch
            mask += ["--method", method, "--micro", str(DEFAULT_MICRO.get((model, method), args.samples_per_step))]
        return [
            py,
            "-m",
            "llmft.benchmarks.gpu.arm_hf",
            "--arm",
            arm.split("-")[0],
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            *mask,
            *common,
        ]
    if arm == "project-product":  # the shipped config decides everything else: of --extra only --nproc
        run = ["--model", model, "--method", method, "--steps", str(args.steps), "--warmup", str(args.warmup)]
        run += ["--nproc", str(_extra_nproc(args.extra)), *getattr(args, "product_extra", "").split()]
        return [py, "-m", "llmft.benchmarks.gpu.arm_product", *run, "--profile", args.profile, *common[-2:]]
    micro = DEFAULT_MICRO.get((model, method), 32)
    module = "llmft.benchmarks.gpu.arm_fast" if arm == "fastpath" else "llmft.benchmarks.gpu.arm_project"
    return [
        py,
        "-m",
        module,
        "--method",
        method,
        "--micro",
        str(micro),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        *common,
        *args.extra.split(),
    ]


def _extra_nproc(extra: str) -> int:
    """The ``--nproc N`` (or ``--nproc=N``) in ``--extra``, else 1: the one launch flag a product arm takes."""
    words = extra.replace("=", " ").split()
    return int(words[words.index("--nproc") + 1]) if "--nproc" in words else 1


MIN_ARM_TIMEOUT_S = 30.0
"""No arm is cut sooner than this, however little of the run's time is left."""


def _run_job(job: str, args, work: Path, remaining: float) -> dict:
    name = job.replace(":", "_") + (f"_{args.label}" if args.label else "")
    json_out = work / f"{name}.json"
    log = work / f"{name}.log"
    cmd = _job_command(job, args, json_out)
    timeout = max(MIN_ARM_TIMEOUT_S, min(args.arm_timeout_s, remaining))
    started = time.perf_counter()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        # Its own process group: a timeout ends the arm AND the trainer it started, whose GPU memory
        # would otherwise stay taken under the next arm (seen on an H200: 103 GiB held by an orphan).
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(job), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    wall = time.perf_counter() - started
    result = json.loads(json_out.read_text()) if json_out.is_file() else {}
    result.update({"job": job, "label": args.label, "returncode": rc, "wall_s": round(wall, 1), "log": log.name})
    if rc != 0 and not result.get("tokens_per_s") and job != "check":
        result["error_tail"] = log.read_text()[-2000:]
    print(f"[bench] {job}: rc={rc} wall={wall:.0f}s tokens/s={result.get('tokens_per_s')}", flush=True)
    return result


def _env(job: str) -> dict:
    env = dict(os.environ)
    if not job.startswith("project"):
        # One-GPU arms see one GPU: the HF Trainer would otherwise wrap the model in
        # nn.DataParallel over every visible GPU (seen on a 2-GPU machine).
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run(args: argparse.Namespace) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    check: dict = {}
    arms: list[dict] = []
    for job in [j.strip() for j in args.jobs.split(",") if j.strip()]:
        remaining = args.deadline_s - (time.perf_counter() - start)
        if remaining < 30:
            print(f"[bench] {job}: skipped, deadline reached", flush=True)
            arms.append({"job": job, "skipped": "deadline"})
            continue
        result = _run_job(job, args, work, remaining)
        if job == "check":
            check = result
        else:
            arms.append(result)
        _write_outputs(args, check, arms)
    _write_outputs(args, check, arms)
    return 0


def _write_outputs(args, check: dict, arms: list[dict]) -> None:
    merged_in = _previous_payloads(None, args.merge_from)
    device = next((a.get("device") for a in [check, *arms, *merged_in] if a.get("device")), "unknown-device")
    date = _dt.date.today().isoformat()
    tag = f"{date}-{device.replace('NVIDIA ', '').split()[0].lower()}"
    out = Path(args.out)
    previous = _previous_payloads(out / f"{tag}.json", "") + merged_in
    check = check or next((p["kernel_checks"] for p in previous if p.get("kernel_checks")), {})
    arms = _merge_arms([a for p in previous for a in p.get("arms", [])], arms)
    versions = {
        k: v
        for k, v in (check or next((a for a in arms if a.get("torch")), {})).items()
        if k in ("torch", "transformers", "peft", "triton", "liger_kernel", "deepspeed")
    }
    payload = {
        "device": device,
        "date": date,
        "versions": versions,
        "matmul_tflops": check.get("matmul_tflops"),
        "profile": args.profile,
        "samples_per_step": args.samples_per_step,
        "kernel_checks": check,
        "arms": arms,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{tag}.json", json.dumps(payload, indent=2))
    atomic_write_text(out / f"{tag}.md", markdown_table(payload))


def _previous_payloads(current: Path | None, merge_from: str) -> list[dict]:
    """Result files already written this session (same file, or a folder of others) to merge with."""
    paths = [current] if current is not None and current.is_file() else []
    if merge_from and Path(merge_from).is_dir():
        paths += sorted(p for p in Path(merge_from).glob("20*-*.json") if "data" not in p.name)
    return [json.loads(p.read_text()) for p in paths]


def _merge_arms(old: list[dict], new: list[dict]) -> list[dict]:
    """Old arms, each replaced by a new arm of the same job and label; new ones appended."""
    key = lambda a: (a.get("job"), a.get("label", ""))  # noqa: E731
    fresh = {key(a): a for a in new}
    merged = [fresh.pop(key(a), a) for a in old]
    seen = {key(a) for a in merged}
    return merged + [a for a in new if key(a) not in seen]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(payload: dict) -> str:
    lines = [
        f"# Training throughput, {payload['device']}, {payload['date']}",
        "",
        f"bf16 matmul 8192^3: {_fmt(payload.get('matmul_tflops'), '.0f')} TFLOP/s; profile {payload['profile']}; "
        f"versions {payload['versions']}",
        "",
        "| arm | model | method | GPUs | label | samples/step | tokens/s | supervised tok/s | MFU | peak GiB | "
        "reserved GiB | step p50 s | step p90 s | compile s | first losses | device |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    paths = []
    for a in payload["arms"]:
        if "tokens_per_s" not in a:
            lines.append(
                f"| {a.get('job')} | failed or skipped: {a.get('skipped') or a.get('returncode')} | | | "
                f"{a.get('label', '')} ||||||||||"
            )
            continue
        losses = ", ".join(f"{x:.4f}" for x in a.get("first_losses") or [])
        lines.append(
            f"| {a['arm']} | {a['model']} | {a['method']} | {a.get('gpus', 1)} | {a.get('label', '')} | "
            f"{a.get('samples_per_step', '-')} | {_fmt(a['tokens_per_s'], ',.0f')} | "
            f"{_fmt(a.get('supervised_tokens_per_s'), ',.0f')} | {_fmt(a.get('mfu') and 100 * a['mfu'], '.1f')}% | "
            f"{_fmt(a.get('peak_mem_gib'), '.1f')} | {_fmt(a.get('reserved_mem_gib'), '.1f')} | "
            f"{_fmt(a.get('step_s_p50'), '.3f')} | {_fmt(a.get('step_s_p90'), '.3f')} | "
            f"{_fmt(a.get('compile_s'), '.0f')} | {losses} | {a.get('device', '-')} |"
        )
        load = f"; load peak {a['load_peak_gib']:.1f} GiB" if a.get("load_peak_gib") is not None else ""
        paths.append(f"- {a['arm']} {a['model']} {a['method']} {a.get('label', '')}: {a.get('kernel_path', '-')}{load}")
    if paths:
        lines += ["", "Kernel path of each row (its fast_path record):", "", *paths]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
