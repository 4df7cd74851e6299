"""`python -m llmft.benchmarks.gpu.trainer_entry [trainer args]`: `python -m llmft.trainer` for the benchmark.

It registers llmft/trainer/fastpath's attention first and wraps
trainer.model.load_model only to print when the model is ready (compile time =
first step record - that moment). The trainer applies the fast path itself
(kernels.compile / kernels.fused_lora); for an older trainer without
trainer.model.apply_fastpath_kernels the harness applies it. Everything else is
the trainer's own code path, unchanged.

``BENCH_SKIP_SAVES=1`` (the project arm sets it): no checkpoint and no ``final/`` are written (a
benchmark measures steps; an 8B ZeRO-3 checkpoint with its optimizer state is over 100 GB and a
1.5B full one over 20 GB, which filled a 64 GB device disk in issue 28).

``BENCH_PROFILE_STEPS=A:B`` (optional) runs torch.profiler over trainer steps A..B and prints how
much of their wall time the GPU was busy, plus the top kernels; ``BENCH_PROFILE_OUT`` is the folder
for the gzipped Chrome trace (default: the working directory; ``BENCH_PROFILE_TRACE=0`` writes none). The
report also sums the GPU time by kernel family and inside the MoE experts' named ranges (``moe.*``:
llmft/trainer/fastpath/moe.py), where the profile of a mixture-of-experts step goes.

``BENCH_STEP_MARKS=FILE`` (optional) appends one JSON line per step, ``{"step": s, "time": t}``, taken when
step s starts, after a device synchronize: the end of step s - 1 (arm_product.py times windows from them
where the config's ``log_every`` leaves too few train records; each mark costs one sync a step).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from llmft.trainer.__main__ import main as trainer_main


def main() -> int:
    # heavy: torch
    from llmft.trainer import model as trainer_model

    # heavy: torch
    from llmft.trainer.fastpath import apply_kernels

    # heavy: torch
    from llmft.trainer.fastpath.attention import register

    register()
    # The trainer applies trainer.fastpath itself (kernels.compile / kernels.fused_lora) when it
    # has trainer.model.apply_fastpath_kernels; only older trainers need the harness to do it.
    hooked = hasattr(trainer_model, "apply_fastpath_kernels")
    original = trainer_model.load_model

    def load_model(cfg, device, **kwargs):
        model, fast_path = original(cfg, device, **kwargs)
        if cfg.kernels.compile and not hooked:
            print(
                f"[trainer_entry] fast path applied by the harness: {apply_kernels(model, compile_layers=True)}",
                flush=True,
            )
        if device.type == "cuda":
            # heavy: torch
            import torch

            segments = torch.cuda.memory._snapshot()["segments"]
            print(f"[trainer_entry] expandable segments: {any(s.get('is_expandable') for s in segments)}", flush=True)
        print(f"[trainer_entry] loaded={time.time()}", flush=True)  # compile time = first step record - this
        return model, fast_path

    trainer_model.load_model = load_model
    if os.environ.get("BENCH_SKIP_SAVES") == "1":
        skip_saves()
    if os.environ.get("BENCH_STEP_MARKS"):  # wrapped first: the profiler's report comes before the next mark
        mark_steps(os.environ["BENCH_STEP_MARKS"])
    if os.environ.get("BENCH_PROFILE_STEPS"):
        profile_steps(os.environ["BENCH_PROFILE_STEPS"], os.environ.get("BENCH_PROFILE_OUT", "."))
    return trainer_main(sys.argv[1:])


def skip_saves() -> None:
    """The trainer writes no checkpoint and no final/ (its summary names a final/ that does not exist)."""

    # heavy: torch
    from llmft.trainer.train import Trainer

    def no_save(run, step, wall, evaluated):
        return None

    def no_final(run):
        print("[trainer_entry] BENCH_SKIP_SAVES=1: no checkpoint and no final/ written", flush=True)
        return Path(run.cfg.output_dir) / "final-not-written"

    setattr(Trainer, "_save", no_save)  # noqa: B010 - a class attribute on purpose (mypy: no method-assign)
    setattr(Trainer, "_write_final", no_final)  # noqa: B010


def profile_steps(spec: str, out_dir: str) -> None:
    """``BENCH_PROFILE_STEPS=A:B``: torch.profiler over trainer steps A..B (whole steps: forward,
    backward, optimizer, logging). Prints how much of the wall time the GPU ran kernels (the rest
    is the GPU waiting on the host) and the top kernels; writes a Chrome trace to ``out_dir``."""
    # heavy: torch
    import torch

    # heavy: torch
    from torch.profiler import ProfilerActivity, profile

    # heavy: torch
    from llmft.trainer.train import Trainer

    first, last = (int(v) for v in spec.split(":"))
    original, state = Trainer.forward_backward, {}

    def forward_backward(run, batch):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        if batch.step == first:
            sync()
            state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        elif batch.step == last + 1 and "prof" in state:
            sync()
            wall = time.perf_counter() - state["t0"]
            prof = state.pop("prof")
            prof.__exit__(None, None, None)
            report_profile(prof, wall, last - first + 1, out_dir)
        return original(run, batch)

    Trainer.forward_backward = forward_backward


def mark_steps(path: str) -> None:
    """``BENCH_STEP_MARKS``: a synchronized timestamp at the start of every step (module doc)."""
    # heavy: torch
    import torch

    # heavy: torch
    from llmft.trainer.train import Trainer

    original = Trainer.forward_backward

    def forward_backward(run, batch):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        with open(path, "a") as marks:
            marks.write(json.dumps({"step": batch.step, "time": time.time()}) + "\n")
        return original(run, batch)

    Trainer.forward_backward = forward_backward


KERNEL_FAMILIES = (
    ("4-bit dequantization (bitsandbytes)", r"kDequantize|dequantize"),
    ("flash attention", r"flash|fmha|attention"),
    ("matmuls (cuBLAS / CUTLASS)", r"gemm|cutlass|nvjet|sm90_xmma|Gemm|wgmma"),
    ("sort / routing", r"[Ss]ort|scan|searchsorted|index|gather|scatter|bincount|histogram"),
    ("optimizer / grad norm", r"multi_tensor|adam|Adam|norm_kernel|foreach"),
    ("compiled elementwise (Inductor Triton)", r"^triton_"),
    ("project Triton kernels", r"^_|lora|philox|loss"),
    ("copies / fills", r"copy|Memcpy|Memset|fill|cat"),
)


def kernel_families(events) -> list[tuple[str, float]]:
    """(family, GPU seconds) of every CUDA kernel of the profile's ``events``, by name (first matching family);
    ranges (``record_function`` names, which the profiler also shows on the GPU's timeline) are not kernels."""
    totals: dict[str, float] = {}
    for event in events:
        if (
            event.device_type.name != "CUDA"
            or getattr(event, "is_user_annotation", False)
            or event.name.startswith("moe.")
        ):
            continue
        family = next((f for f, pattern in KERNEL_FAMILIES if re.search(pattern, event.name)), "other")
        totals[family] = totals.get(family, 0.0) + (event.time_range.end - event.time_range.start) / 1e6
    return sorted(totals.items(), key=lambda kv: -kv[1])


def named_ranges(averages, prefix: str = "moe.") -> list[tuple[str, float, int]]:
    """(range, GPU seconds of the kernels launched inside it, calls) of every ``record_function`` range
    whose name starts with ``prefix`` (the profiler lists each twice, as the host's range and as its span on
    the GPU's timeline: the larger is kept)."""
    rows: dict[str, tuple[float, int]] = {}
    for avg in averages:
        if avg.key.startswith(prefix):
            device = getattr(avg, "device_time_total", None)
            device = (avg.cuda_time_total if device is None else device) / 1e6
            rows[avg.key] = max(rows.get(avg.key, (0.0, 0)), (device, avg.count))
    return sorted(((k, v[0], v[1]) for k, v in rows.items()), key=lambda r: -r[1])


def gpu_busy_seconds(prof, events=None) -> float:
    """Union of the CUDA kernel/memcpy intervals (seconds): time the GPU was doing anything."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in (prof.events() if events is None else events)
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            busy += 0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += 0 if cur_end is None else cur_end - cur_start
    return busy / 1e6  # profiler times are microseconds


def report_profile(prof, wall: float, steps: int, out_dir: str) -> None:
    events = prof.events()  # built once: a 48-layer MoE step has a few hundred thousand
    busy = gpu_busy_seconds(prof, events)
    print(
        f"[profile] {steps} steps: wall {wall * 1e3:.1f} ms, GPU busy {busy * 1e3:.1f} ms "
        f"({100 * busy / wall:.1f}%), GPU idle {(wall - busy) * 1e3 / steps:.1f} ms per step",
        flush=True,
    )
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90), flush=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=90), flush=True)
    families = kernel_families(events)
    summary = {"steps": steps, "wall_s": wall, "gpu_busy_s": busy, "families_s": dict(families)}
    print("[profile] GPU time by kernel family (per profiled step):", flush=True)
    for family, seconds in families:
        print(f"[profile]   {family:<44} {seconds * 1e3 / steps:10.1f} ms  {100 * seconds / wall:5.1f}% of wall")
    ranges = named_ranges(averages)
    if ranges:
        summary["moe_ranges_s"] = {name: seconds for name, seconds, _ in ranges}
        print("[profile] GPU time inside the MoE experts' ranges (per profiled step):", flush=True)
        for name, seconds, calls in ranges:
            print(f"[profile]   {name:<44} {seconds * 1e3 / steps:10.1f} ms  {calls:6d} calls")
    print(f"[profile-json] {json.dumps(summary)}", flush=True)
    if os.environ.get("BENCH_PROFILE_TRACE", "1") == "0":
        return
    trace = os.path.join(out_dir, f"trace-{os.getpid()}.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)


if __name__ == "__main__":
    sys.exit(main())
