"""Helpers for the trainer tests: run the trainer as a subprocess or through torchrun,
read metrics.jsonl and adapters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KATIB_REGEX = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"


def clean_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MLFLOW_", "LANGFUSE_", "LLMFT_", "PET_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra})
    return env


def run_trainer(
    overrides: list[str], *, nproc: int = 1, timeout: int = 240, env: dict | None = None, config: str | None = None
) -> subprocess.CompletedProcess:
    """`python -m llmft.trainer ...` (nproc 1) or `llmft train --nproc N ...` (torchrun), captured."""
    head = ["--config", config] if config else []
    if nproc == 1:
        cmd = [sys.executable, "-m", "llmft.trainer", *head, *overrides]
    else:
        cmd = [sys.executable, "-m", "llmft", "train", "--nproc", str(nproc), *head, *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def events(output_dir: Path, kind: str | None = None) -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [r for r in records if kind is None or r["event"] == kind]


def adapter_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "adapter_model.safetensors"))


def train_in_process(overrides: list[str]) -> tuple[object, str]:
    """Run a LoRA/full recipe in this process; returns (recipe, captured stdout)."""
    import contextlib
    import io
    import signal

    from llmft.trainer.__main__ import main

    previous = signal.getsignal(signal.SIGTERM)
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = main(overrides)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code, stdout.getvalue()
