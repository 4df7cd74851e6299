"""Small helpers shared by the data-layer tests (unique module name: tests/*/ dirs share sys.path)."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows may be dicts (dumped as JSON) or raw strings (written verbatim)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def chat(*turns: str, system: str | None = None) -> dict:
    """{"messages": [...]} from alternating user/assistant contents."""
    messages = [{"role": "system", "content": system}] if system else []
    for i, content in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {"messages": messages}
