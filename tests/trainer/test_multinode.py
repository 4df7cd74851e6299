"""The multi-node path for real, on this CPU: two "nodes" of one rank each, each started the way
a PyTorchJob pod starts it (`llmft train --nproc 1` with the rendezvous environment the
Training Operator injects), rendezvousing over loopback with gloo.

The environment follows the Training Operator v1.9.4 PyTorch controller
(kubeflow/trainer `pkg/controller.v1/pytorch/envvar.go`, setPodEnv): MASTER_ADDR/MASTER_PORT and
PET_MASTER_ADDR/PET_MASTER_PORT (the master's service, port 23456 by default), PET_NNODES (the
replica count), PET_NODE_RANK (0 on the Master, i+1 on Worker i) and PET_NPROC_PER_NODE; torchrun
reads the PET_* variables as its own flags. Here both "pods" share one host, so the master address
is 127.0.0.1 and the port a free one.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from trainer_helpers import REPO, adapter_tensors, clean_env, events

from llmft.trainer.io import is_complete

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_env(node_rank: int, port: int) -> dict:
    return clean_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PET_MASTER_ADDR="127.0.0.1",
        PET_MASTER_PORT=str(port),
        PET_NNODES="2",
        PET_NODE_RANK=str(node_rank),
        PET_NPROC_PER_NODE="1",
    )


def _start_nodes(overrides: list[str]) -> list[subprocess.Popen]:
    port = _free_port()
    cmd = [sys.executable, "-m", "llmft", "train", "--nproc", "1", *overrides]
    return [
        subprocess.Popen(
            cmd, cwd=REPO, env=_node_env(rank, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for rank in (0, 1)
    ]


def _overrides(base_overrides, output: str, **extra) -> list[str]:
    values = {"max_steps": 4, "save_every": 2, "keep_last": 5, "lora__dropout": 0.0, **extra}
    return base_overrides(output, **values)


def _finish(nodes: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    out = []
    for proc in nodes:
        text, _ = proc.communicate(timeout=timeout)
        out.append((proc.returncode, text))
    return out


def test_two_nodes_train_the_same_run_as_one_node_with_two_ranks(base_overrides, tmp_path):
    single = _overrides(base_overrides, "single")
    done = subprocess.run(
        [sys.executable, "-m", "llmft", "train", "--nproc", "2", *single],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    results = _finish(_start_nodes(_overrides(base_overrides, "nodes")))
    for code, text in results:
        assert code == 0, text[-3000:]
    assert "2 rank(s)" in results[0][1]  # both nodes joined one world of two ranks

    one, two = tmp_path / "single", tmp_path / "nodes"
    # The same ranks compute the same sums in the same order whether they share a host or not:
    # gloo's all-reduce of two float32 buffers is a single addition, so the runs agree to the bit
    # up to the order of that addition; compare at float32 rounding of the summed gradients.
    for a, b in zip(events(two, "train"), events(one, "train"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=4 * torch.finfo(torch.float32).eps)
    # The adapters went through Adam, which lets a gradient that cancels to within that addition's
    # rounding move either way: isolated elements, bounded as in tests/float_bounds.py (n = 2 terms).
    from float_bounds import assert_adam_runs_agree

    a, b = adapter_tensors(two / "final"), adapter_tensors(one / "final")
    assert_adam_runs_agree(a, b, [e["lr"] for e in events(one, "train")], n=2)


def test_sigterm_to_one_node_commits_a_checkpoint_and_both_nodes_resume(base_overrides, tmp_path):
    """Preemption of the Worker pod: SIGTERM reaches its `llmft train`, which forwards it to its rank;
    the stop flag is all-reduced, so both nodes commit the same checkpoint and exit 143 (retryable
    under the ExitCode restart policy); restarting both "pods" resumes from that checkpoint."""
    overrides = _overrides(base_overrides, "preempted", max_steps=12, save_every=0)
    nodes = _start_nodes(overrides)
    deadline = time.monotonic() + 240
    seen = []
    for line in nodes[0].stdout:
        seen.append(line)
        if line.startswith("step=2 "):
            nodes[1].send_signal(signal.SIGTERM)  # only the Worker is preempted
            break
        assert time.monotonic() < deadline, "".join(seen[-20:])
    results = _finish(nodes)
    assert [code for code, _ in results] == [143, 143], [t[-2000:] for _, t in results]
    out = tmp_path / "preempted"
    committed = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir() if is_complete(p))
    assert len(committed) == 1 and 2 <= committed[0] < 12 and not (out / "final").exists()

    resumed = _finish(_start_nodes(overrides))  # the restarted pods run the same command
    for code, text in resumed:
        assert code == 0, text[-3000:]
    assert f"resuming from {out / 'checkpoints' / f'step-{committed[0]}'}" in resumed[0][1]
    assert events(out, "train")[-1]["step"] == 12
    assert (out / "final" / "training_manifest.json").is_file()
