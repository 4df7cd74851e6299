"""Tokenize onto the shared volume at a content-addressed path: ``<root>/tokenized/<cache_key>``.

The key is the one ``trainer.data.tokenize`` computes (data files, tokenizer, chat template,
max length, packing, truncation). Computing it first lets every pipeline run and Katib
trial with the same inputs find the same folder, where the tokenizer's own cache check
answers ``cache hit`` and rewrites nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def tokenized_cache_key(input_dir: str | Path, model: str, *, max_length: int, pack: bool,
                        truncation: str = "drop", chat_template: str | None = None) -> str:
    """The cache key ``tokenize_dataset`` will give these inputs (mirrors its first steps)."""
    from trainer.data import tokenize as tok
    from trainer.data.encode import EncodePlan
    from trainer.data.templates import end_of_turn_marker, resolve_chat_template

    input_dir = Path(input_dir)
    split_files = tok.find_split_files(input_dir)
    tokenizer = tok.load_tokenizer(model)
    template, source = resolve_chat_template(tokenizer, chat_template)
    plan = EncodePlan(template, end_of_turn_marker(tokenizer, template) if template else "", max_length, truncation)
    return tok._identity(input_dir, split_files, model, tokenizer, plan, source, pack)["cache_key"]


def tokenize_to_volume(input_dir: str | Path, model: str, root: str | Path, *, max_length: int,
                       pack: bool) -> dict[str, Any]:
    """Tokenize ``input_dir`` into ``<root>/tokenized/<cache_key>``; the manifest gains ``path``."""
    from trainer.data.tokenize import tokenize_dataset

    key = tokenized_cache_key(input_dir, model, max_length=max_length, pack=pack)
    output_dir = Path(root) / "tokenized" / key
    manifest = tokenize_dataset(input_dir, model, output_dir, max_length=max_length, pack=pack)
    if manifest["cache_key"] != key:  # the tokenizer's key definition moved: keep the folder honest
        from trainer.errors import DataError

        raise DataError(f"{output_dir}: cache key {manifest['cache_key']} differs from the precomputed {key}; "
                        "components/lib/tokenized.py no longer mirrors trainer.data.tokenize")
    return {**manifest, "path": str(output_dir)}


def manifest_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """Scalar facts of a tokenize manifest worth showing as KFP metrics."""
    out: dict[str, float] = {}
    for split, stats in (manifest.get("splits") or {}).items():
        for name, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{split}_{name}"] = float(value)
    return out
