"""Fixtures for the real-vLLM tests: the serving virtualenv and a LoRA adapter trained by `llmft train`
on the project's tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# deploy_request and peft_adapter (tests/pipeline/adapter_helpers.py) build the deploy step's requests here too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))


@pytest.fixture(scope="session")
def serving_venv() -> Path:
    """The serving virtualenv (`make serving-venv`): skipped here when absent, a failure under CI=true."""
    from llmft.components.lib.serving.vllm_local import serving_venv as where

    venv = where()
    if not (venv / "bin" / "python").is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"no serving virtualenv at {venv}: CI builds it with `make serving-venv` (.ci/run)")
        pytest.skip(f"no serving virtualenv at {venv}: build it with `make serving-venv`")
    return venv


@pytest.fixture(scope="session")
def trained_adapter(tmp_path_factory, tiny_model_dir) -> Path:
    """A LoRA r8 (all linear layers) trained for a few steps by `llmft train` on the tiny model: its ``final/``
    adapter as the trainer writes it (tokenizer and manifest beside the weights)."""
    from llmft.demo import sample_path
    from llmft.trainer.data.prepare import prepare_dataset
    from llmft.trainer.data.tokenize import tokenize_dataset

    root = tmp_path_factory.mktemp("vllm-adapter")
    prepare_dataset(str(sample_path("alpaca_demo")), root / "prepared", val_fraction=0.1)
    tokenize_dataset(root / "prepared", str(tiny_model_dir), root / "tokenized", max_length=128, pack=True, num_proc=1)
    overrides = {
        "model.name_or_path": tiny_model_dir,
        "data": root / "tokenized",
        "output_dir": root / "run",
        "lora.r": 8,
        "lora.alpha": 16,
        "lora.dropout": 0.0,
        "optim.lr": 1e-2,
        "schedule.warmup_steps": 1,
        "batch.global_sequences": 4,
        "batch.micro_sequences": 4,
        "observe.progress_bar": "false",
        "max_steps": 6,
        "seed": 0,
    }
    cmd = [sys.executable, "-m", "llmft", "train", *(f"{k}={v}" for k, v in overrides.items())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    final = root / "run" / "final"
    assert (final / "adapter_model.safetensors").is_file(), sorted(p.name for p in (root / "run").rglob("*"))
    return final
