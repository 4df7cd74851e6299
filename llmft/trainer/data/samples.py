"""Sample datasets shipped with the package (used by the demo, tests and notebooks).

- ``alpaca_demo.jsonl``: about 500 Alpaca rows written in the tiny model's vocabulary,
  with 3 deliberately broken rows (invalid JSON, empty output, missing instruction)
  so a demo shows rejections while staying under the default 1% reject limit.
- ``chat_demo.jsonl``: multi-turn OpenAI ``messages`` conversations with system turns.
"""

from __future__ import annotations

from pathlib import Path

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "assets" / "sample_data"


def sample_names() -> list[str]:
    return sorted(p.name for p in SAMPLE_DIR.glob("*.jsonl"))


def sample_path(name: str) -> Path:
    """Path of a shipped sample, by file name with or without ``.jsonl``."""
    path = SAMPLE_DIR / (name if name.endswith(".jsonl") else f"{name}.jsonl")
    if not path.is_file():
        raise FileNotFoundError(f"no sample dataset {name!r}; shipped: {', '.join(sample_names())}")
    return path
