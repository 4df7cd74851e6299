"""The multi-node path on one host: two torchrun "nodes" of N GPUs each, started the way
PyTorchJob pods start them, against the same run on one node of 2N GPUs; then preemption of one node.

Each "pod" runs ``llmft train --nproc N`` with the rendezvous environment the Training Operator
v1.9.4 injects (MASTER_ADDR/PORT, PET_MASTER_ADDR/PORT, PET_NNODES, PET_NODE_RANK,
PET_NPROC_PER_NODE; kubeflow/trainer pkg/controller.v1/pytorch/envvar.go) and its own
CUDA_VISIBLE_DEVICES. tests/trainer/test_multinode.py runs the same on CPU (gloo).

1. single: one node, ``--nproc 2N`` (standalone rendezvous).
2. nodes:  two nodes of ``--nproc N``; per-step losses compared with (1).
3. preempt: two nodes, SIGTERM to node 1's ``llmft train`` after step K; both must exit 143 with one
   complete checkpoint; then both restart with the same command and must resume from it and finish.

python -m llmft.benchmarks.gpu.multinode --model qwen2.5-0.5b --gpus-per-node 2 --json-out F
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from llmft.benchmarks.gpu import arm_project, common


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overrides(model_dir: Path, data_dir: Path, out: Path, steps: int, a) -> list[str]:
    per_step = 2 * a.gpus_per_node * a.samples_per_gpu // a.pack
    return [
        f"model.name_or_path={model_dir}",
        f"data={data_dir}",
        f"output_dir={out}",
        "lora.r=16",
        "lora.alpha=32",
        "lora.dropout=0.0",
        "schedule.decay=constant",
        "schedule.warmup_steps=0",
        f"batch.global_sequences={per_step}",
        f"batch.micro_sequences={a.samples_per_gpu // a.pack}",
        f"max_steps={steps}",
        "log_every=1",
        "eval_every=0",
        "save_every=0",
        "eval.max_sequences=4",
        f"kernels.compile={'true' if a.compile else 'false'}",
        "observe.progress_bar=false",
        "seed=42",
    ]


def _node_env(rank: int, port: int, a) -> dict:
    gpus = range(rank * a.gpus_per_node, (rank + 1) * a.gpus_per_node)
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PET_MASTER_ADDR="127.0.0.1",
        PET_MASTER_PORT=str(port),
        PET_NNODES="2",
        PET_NODE_RANK=str(rank),
        PET_NPROC_PER_NODE=str(a.gpus_per_node),
    )


def _train_cmd(nproc: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "llmft", "train", "--nproc", str(nproc), *overrides]


def _start_nodes(overrides: list[str], a, logs: Path, tag: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in (0, 1):
        log = open(logs / f"{tag}-node{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                _train_cmd(a.gpus_per_node, overrides), env=_node_env(rank, port, a), stdout=log, stderr=log, text=True
            )
        )
    return procs


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r.get("event") == "train"}


def _wait_for_step(log: Path, step: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.is_file() and any(line.startswith(f"step={step} ") for line in log.read_text().splitlines()):
            return True
        time.sleep(0.5)
    return False


def _complete_checkpoints(out: Path) -> list[int]:
    root = out / "checkpoints"
    steps = [p for p in root.iterdir() if (p / "COMPLETE").is_file()] if root.is_dir() else []
    return sorted(int(p.name.split("-")[1]) for p in steps)


def run(a) -> dict:
    root, logs = Path(a.work), Path(a.logs)
    logs.mkdir(parents=True, exist_ok=True)
    vocab = common.MODEL_SHAPES[a.model]["vocab_size"]
    samples = common.make_samples(2 * a.gpus_per_node * a.samples_per_gpu * a.steps, "short", vocab)
    model_dir = arm_project.write_model_dir(a.model, root / "models")
    data_dir = arm_project.write_dataset(samples, a.pack, root / "data" / f"multinode-{a.model}")
    result: dict = {"model": a.model, "gpus_per_node": a.gpus_per_node, "steps": a.steps, **common.device_info()}

    started = time.perf_counter()
    single = root / "runs" / "single"
    with open(logs / "single.log", "w") as log:
        code = subprocess.run(
            _train_cmd(2 * a.gpus_per_node, _overrides(model_dir, data_dir, single, a.steps, a)),
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=log,
            stderr=log,
        ).returncode
    result["single"] = {"returncode": code, "wall_s": time.perf_counter() - started}
    common.write_json(a.json_out, result)  # after every phase: a call cut short keeps what was measured

    started = time.perf_counter()
    nodes = root / "runs" / "nodes"
    procs = _start_nodes(_overrides(model_dir, data_dir, nodes, a.steps, a), a, logs, "nodes")
    result["nodes"] = {
        "returncodes": _wait_all(procs, a.timeout),
        "wall_s": time.perf_counter() - started,
    }
    if code == 0 and result["nodes"]["returncodes"] == [0, 0]:
        one, two = _losses(single), _losses(nodes)
        diffs = [abs(two[s] - one[s]) / abs(one[s]) for s in sorted(one)]
        result["losses"] = {"single": [one[s] for s in sorted(one)], "nodes": [two[s] for s in sorted(two)]}
        result["max_relative_loss_difference"] = max(diffs)
    common.write_json(a.json_out, result)

    preempted = root / "runs" / "preempted"
    overrides = _overrides(model_dir, data_dir, preempted, a.steps, a)
    procs = _start_nodes(overrides, a, logs, "preempt")
    reached = _wait_for_step(logs / "preempt-node0.log", a.preempt_at, a.timeout)
    procs[1].send_signal(signal.SIGTERM)  # the Worker pod is preempted; its llmft train forwards the signal
    codes = _wait_all(procs, a.timeout)
    committed = _complete_checkpoints(preempted)
    result["preempt"] = {
        "signalled_after_step": a.preempt_at if reached else None,
        "returncodes": codes,
        "complete_checkpoints": committed,
    }
    common.write_json(a.json_out, result)
    procs = _start_nodes(overrides, a, logs, "resume")  # the restarted pods run the same command
    codes = _wait_all(procs, a.timeout)
    resumed_line = next(
        (line for line in (logs / "resume-node0.log").read_text().splitlines() if "resuming from" in line), None
    )
    result["resume"] = {
        "returncodes": codes,
        "log": resumed_line,
        "final": (preempted / "final" / "training_manifest.json").is_file(),
        "last_step": max(_losses(preempted), default=None),
    }
    common.write_json(a.json_out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1, default=str), flush=True)
    for run_dir in (single, nodes, preempted):  # this program's own runs; the result is written
        common.remove_run_dir(run_dir)
    return result


def _wait_all(procs, timeout: float) -> list[int | None]:
    """Each process's exit code; one still running after ``timeout`` seconds is killed (None)."""
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append(None)
    return codes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(common.MODEL_SHAPES))
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--samples-per-gpu", type=int, default=64)
    p.add_argument("--pack", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--preempt-at", type=int, default=10)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--work", default="/tmp/llmft-project")
    p.add_argument("--logs", default="/tmp/llmft-multinode-logs", help="one log file per process")
    p.add_argument("--json-out", required=True)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
