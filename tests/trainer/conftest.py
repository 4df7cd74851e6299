"""Fixtures for the trainer tests: one tokenized dataset (the shipped Alpaca
sample, prepared and tokenized with the real data layer onto the tiny model),
and helpers that run the trainer in-process, as a subprocess, or through
torchrun (`llmft train --nproc N`)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokenized_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """alpaca_demo -> prepare (10% val) -> tokenize (packed, 128 tokens) on the tiny model."""
    from llmft.demo import sample_path
    from llmft.trainer.data.prepare import prepare_dataset
    from llmft.trainer.data.tokenize import tokenize_dataset

    root = tmp_path_factory.mktemp("trainer-data")
    prepare_dataset(str(sample_path("alpaca_demo")), root / "prepared", val_fraction=0.1)
    tokenize_dataset(root / "prepared", str(tiny_model_dir), root / "tokenized", max_length=128, pack=True, num_proc=1)
    return root / "tokenized"


@pytest.fixture
def base_overrides(tiny_model_dir, tokenized_dir, tmp_path):
    """Overrides for a small, quiet, deterministic run in a fresh output dir."""

    def make(output: str = "run", **extra) -> list[str]:
        values = {
            "model.name_or_path": str(tiny_model_dir),
            "data": str(tokenized_dir),
            "output_dir": str(tmp_path / output),
            "lora.r": 4,
            "lora.alpha": 8,
            "lora.dropout": 0.0,
            "optim.lr": 5e-3,
            "schedule.warmup_steps": 1,
            "batch.global_sequences": 4,
            "batch.micro_sequences": 2,
            "eval.max_sequences": 8,
            "observe.progress_bar": "false",
            "max_steps": 4,
            "log_every": 1,
            "seed": 3,
        }
        values.update({k.replace("__", "."): v for k, v in extra.items()})
        return [f"{k}={v}" for k, v in values.items()]

    return make


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny CPU models run faster on one thread, and far faster when other jobs share the cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
