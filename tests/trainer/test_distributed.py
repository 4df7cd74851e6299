"""Real torchrun processes on CPU (gloo): rank-count independence, DeepSpeed ZeRO,
non-finite steps on one rank, SIGTERM through `llmft train --nproc`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch
from llmft.trainer.io import is_complete
from trainer_helpers import REPO, adapter_tensors, clean_env, events, run_trainer, train_in_process

pytestmark = pytest.mark.slow


def _assert_adapters_close(a_dir, b_dir, atol=2e-5):
    a, b = adapter_tensors(a_dir), adapter_tensors(b_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=name)
    assert any(t.abs().max() > 1e-3 for t in a.values())  # the adapters really trained


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_model_dir, tokenized_dir):
    """The single-process reference at a global batch of 4 sequences."""
    out = tmp_path_factory.mktemp("dist") / "one"
    code, _ = train_in_process(_overrides(tiny_model_dir, tokenized_dir, out))
    assert code == 0
    return out


def _overrides(model, data, out, *extra) -> list[str]:
    return [
        f"model.name_or_path={model}",
        f"data={data}",
        f"output_dir={out}",
        "lora.r=4",
        "lora.alpha=8",
        "lora.dropout=0.0",
        "optim.lr=5e-3",
        "batch.global_sequences=4",
        "batch.micro_sequences=1",
        "eval.max_sequences=4",
        "observe.progress_bar=false",
        "max_steps=3",
        "log_every=1",
        "seed=5",
        *extra,
    ]


def test_two_ranks_equal_one_rank(one_rank, tiny_model_dir, tokenized_dir, tmp_path):
    out = tmp_path / "two"
    result = run_trainer(_overrides(tiny_model_dir, tokenized_dir, out), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_adapters_close(out / "final", one_rank / "final")
    for a, b in zip(events(out, "train"), events(one_rank, "train"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["tokens_seen"] == b["tokens_seen"]
    assert events(out, "eval")[-1]["eval_loss"] == pytest.approx(events(one_rank, "eval")[-1]["eval_loss"], rel=1e-5)
    assert "2 rank(s)" in result.stdout


def test_bf16_gradient_all_reduce_stays_close_to_one_rank(one_rank, tiny_model_dir, tokenized_dir, tmp_path):
    out = tmp_path / "bf16"
    result = run_trainer(
        _overrides(
            tiny_model_dir, tokenized_dir, out, "distributed.grad_reduce_dtype=bf16", "distributed.bucket_cap_mb=1"
        ),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [e["loss"] for e in events(out, "train")]
    reference = [e["loss"] for e in events(one_rank, "train")]
    assert losses[0] == pytest.approx(reference[0], rel=1e-5)  # same forward before any update
    assert losses == pytest.approx(reference, rel=1e-3)
    a, b = adapter_tensors(out / "final"), adapter_tensors(one_rank / "final")
    errors = {name: float((a[name] - b[name]).norm() / b[name].norm()) for name in b if b[name].norm() > 0}
    assert max(errors.values()) < 0.05, max(errors.items(), key=lambda kv: kv[1])  # Adam on bf16-rounded grads
    assert max(errors.values()) > 0  # the hook really ran (fp32 DDP matches one rank to ~1e-6)


def test_deepspeed_zero2_on_cpu_matches_ddp(one_rank, tiny_model_dir, tokenized_dir, tmp_path):
    out = tmp_path / "zero2"
    result = run_trainer(
        _overrides(tiny_model_dir, tokenized_dir, out, "distributed.backend=deepspeed", "distributed.zero_stage=2"),
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_adapters_close(out / "final", one_rank / "final")
    assert (out / "checkpoints" / "step-3" / "deepspeed").is_dir()


def test_nan_on_one_rank_skips_updates_then_aborts_naming_step_and_rank(tiny_model_dir, tokenized_dir, tmp_path):
    out = tmp_path / "nan"
    result = run_trainer(
        _overrides(
            tiny_model_dir,
            tokenized_dir,
            out,
            "max_steps=6",
            "save_every=1",
            "keep_last=10",
            "max_bad_steps=3",
            "debug.nan_steps=[2,3,4]",
            "debug.nan_rank=1",
        ),
        nproc=2,
    )
    assert result.returncode == 1
    assert "step 4: 3 consecutive steps with a non-finite loss" in result.stderr
    assert "rank(s) [1]" in result.stderr
    log = {e["step"]: e for e in events(out, "train")}
    assert [log[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 2, 3] and 5 not in log
    # the skipped updates left the adapter exactly as step 1 made it
    step1, step3 = adapter_tensors(out / "checkpoints/step-1"), adapter_tensors(out / "checkpoints/step-3")
    assert all(torch.equal(step1[k], step3[k]) for k in step1)
    assert not (out / "checkpoints/step-4").exists() and not (out / "final").exists()


def test_sigterm_to_llmft_train_nproc_commits_and_exits_143(tiny_model_dir, tokenized_dir, tmp_path):
    """Kubernetes sends SIGTERM to the container's main process: `llmft train --nproc 2`."""
    out = tmp_path / "preempted"
    cmd = [
        sys.executable,
        "-m",
        "llmft",
        "train",
        "--nproc",
        "2",
        *_overrides(tiny_model_dir, tokenized_dir, out, "max_steps=500"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    deadline = time.monotonic() + 180
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step=2 "):
            proc.send_signal(signal.SIGTERM)
        assert time.monotonic() < deadline, "".join(lines[-20:])
    assert proc.wait(timeout=120) == 143, "".join(lines[-20:])
    committed = [p for p in (out / "checkpoints").iterdir() if is_complete(p)]
    assert len(committed) == 1 and committed[0].name.startswith("step-")
    step = int(committed[0].name.split("-")[1])
    assert 2 <= step < 500 and not (out / "final").exists()
