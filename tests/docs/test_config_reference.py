"""docs/config-reference.md is generated from llmft/trainer/config.py and never stale."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "tools" / "gen_config_reference.py"


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_committed_reference_is_up_to_date():
    """Fails when a config field, default or doc changed without regenerating the file."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + "\nRegenerate: python tools/gen_config_reference.py"


@pytest.mark.slow
def test_check_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "config-reference.md"
    subprocess.run([sys.executable, str(SCRIPT), "--output", str(stale)], check=True, capture_output=True, timeout=120)
    assert (
        subprocess.run(
            [sys.executable, str(SCRIPT), "--check", "--output", str(stale)], capture_output=True, timeout=120
        ).returncode
        == 0
    )
    stale.write_text(stale.read_text().replace("LoRA rank.", "LoRA rank (edited by hand)."))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--output", str(stale)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1 and "stale" in out.stderr


def test_every_config_field_appears_with_its_doc_and_default(generator):
    from llmft.trainer.config import iter_fields

    text = generator.render_reference()
    fields = list(iter_fields())
    assert len(fields) >= 30
    for name, _type, default, doc in fields:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} missing from the reference"
        assert generator._cell(doc) in row, f"{name}: doc not in its row"
        assert generator._cell(generator.format_default(default)) in row, f"{name}: default not in its row"


def test_every_field_has_a_non_empty_doc():
    from llmft.trainer.config import iter_fields

    undocumented = [name for name, _t, _d, doc in iter_fields() if len(doc.strip()) < 5]
    assert not undocumented, f"config fields without a doc line: {undocumented}"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "`null`"),
        (True, "`true`"),
        ("", '`""`'),
        ("sdpa", "`sdpa`"),
        (("all-linear",), "`[all-linear]`"),
        (2e-4, "`0.0002`"),
        ((), "`[]`"),
    ],
)
def test_defaults_are_written_as_yaml(generator, value, expected):
    assert generator.format_default(value) == expected
