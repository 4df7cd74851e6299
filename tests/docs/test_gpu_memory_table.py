"""The README's GPU-memory table is generated from the trainer's memory model and never stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "gen_gpu_memory_table.py"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_gpu_memory_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_holds_the_table_the_memory_model_gives(generator):
    """Fails when the memory model, a model shape or the table's layout changed without regenerating it."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert generator.with_table(text) == text, "stale: run python tools/gen_gpu_memory_table.py"


def test_a_number_edited_by_hand_is_caught(generator):
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(generator.BEGIN)
    row = text.index("| qwen2.5-1.5b | LoRA |", start)
    edited = text[:row] + text[row:].replace("| LoRA | ", "| LoRA | 1", 1)
    assert generator.with_table(edited) != edited


def test_recomputing_every_layer_never_needs_more_memory(generator):
    """The table's two columns come from one model: checkpointing keeps one input per layer instead of its set."""
    for model in generator.MODELS:
        for _, method, zero, world in generator.METHODS:
            setup = generator.setup_of(model, method, zero, world)
            plain = generator.memory.estimate(setup, generator.TOKENS, 0).total
            assert generator.memory.estimate(setup, generator.TOKENS, setup.shape.n_layers).total < plain


def test_the_smallest_card_is_the_first_whose_budget_holds_the_step(generator):
    setup = generator.setup_of("llama-3-8b", "lora", 0, 1)
    need = generator.memory.estimate(setup, generator.TOKENS, setup.shape.n_layers).total
    card = generator.smallest_card(setup)
    free = dict(generator.CARDS)[card] * generator.memory.GiB
    assert need <= generator.memory.budget_bytes(free, generator.memory.exact_bytes(setup))
    smaller = [f for name, f in generator.CARDS if f < free / generator.memory.GiB]
    for f in smaller:
        assert need > generator.memory.budget_bytes(f * generator.memory.GiB, generator.memory.exact_bytes(setup))
