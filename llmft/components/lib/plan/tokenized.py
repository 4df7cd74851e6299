"""Tokenize onto the shared volume at a content-addressed path: ``<root>/tokenized/<cache_key>``.

The key is the one ``llmft.trainer.data.tokenize`` computes (data files, tokenizer, chat template,
max length, packing, truncation). Computing it first lets every pipeline run and Katib
trial with the same inputs find the same folder, where the tokenizer's own cache check
answers ``cache hit`` and rewrites nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmft.trainer.data.tokenize import cache_key_for, tokenize_dataset
from llmft.trainer.errors import DataError
from llmft.trainer.model_dir import check_model_dir


def tokenize_to_volume(
    input_dir: str | Path, model: str, root: str | Path, *, max_length: int, pack: bool, revision: str | None = None
) -> dict[str, Any]:
    """Tokenize ``input_dir`` into ``<root>/tokenized/<cache_key>``; the manifest gains ``path``. A local
    ``model`` directory without weights or tokenizer is refused first (it could not be trained on)."""
    check_model_dir(model)
    key = cache_key_for(input_dir, model, max_length=max_length, pack=pack, revision=revision)
    output_dir = Path(root) / "tokenized" / key
    manifest = tokenize_dataset(input_dir, model, output_dir, max_length=max_length, pack=pack, revision=revision)
    if manifest["cache_key"] != key:  # the tokenizer's key definition moved: keep the folder honest
        raise DataError(
            f"{output_dir}: cache key {manifest['cache_key']} differs from the precomputed {key}; "
            "llmft.trainer.data.tokenize.cache_key_for disagrees with tokenize_dataset"
        )
    return {**manifest, "path": str(output_dir)}


def manifest_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """Scalar facts of a tokenize manifest worth showing as KFP metrics."""
    out: dict[str, float] = {}
    for split, stats in (manifest.get("splits") or {}).items():
        for name, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{split}_{name}"] = float(value)
    return out
