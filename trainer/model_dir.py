"""A local base-model directory is checked before any data is tokenized (so before any GPU time).

:func:`check_model_dir` looks at the files only, not their contents: ``config.json``, safetensors weights
(``model.safetensors``, or the shards a ``model.safetensors.index.json`` names) and a fast tokenizer
(``tokenizer.json``). A missing piece is a one-line :class:`~llmft.trainer.errors.DataError` naming the
directory and the fix, where otherwise tokenizing would succeed and the train step would fail minutes
later. The pipeline's tokenize step calls it first (components/lib/tokenized.py); a missing chat template
is the tokenizer's own check (:func:`llmft.trainer.data.templates.missing_template_error`), also before any
row is tokenized. A hub id (no such local directory) is not checked here: the loaders report it.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmft.trainer.errors import DataError

WEIGHTS_INDEX = "model.safetensors.index.json"
FIX_WRITE = "write a complete one with save_pretrained (or `llmft dev real-model --output DIR`)"


def looks_local(model: str) -> bool:
    """True for a path (absolute, relative with a dot, or an existing directory), False for a hub id."""
    return model.startswith(("/", "./", "../", "~")) or Path(model).is_dir()


def check_model_dir(model: str) -> None:
    """Raise a one-line DataError when the local model directory ``model`` cannot be trained on."""
    if not looks_local(model):
        return
    path = Path(model).expanduser()
    if not path.is_dir():
        raise DataError(f"model {model}: no such directory. Fix: point `model` at a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise DataError(f"model {model}: no config.json, so not a Hugging Face model directory. Fix: {FIX_WRITE}")
    missing = missing_weights(path)
    if missing:
        raise DataError(f"model {model}: {missing}. Fix: {FIX_WRITE} (safetensors weights)")
    if not (path / "tokenizer.json").is_file():
        raise DataError(
            f"model {model}: no tokenizer.json (a fast tokenizer). Fix: save the tokenizer into it "
            "(tokenizer.save_pretrained(DIR))"
        )


def missing_weights(path: Path) -> str:
    """'' when the safetensors weights are all there, else what is missing."""
    index = path / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as exc:
            return f"{WEIGHTS_INDEX} is not a valid index ({type(exc).__name__}: {exc})"
        absent = [s for s in shards if not (path / s).is_file()]
        return f"weight shard(s) {', '.join(absent)} named in {WEIGHTS_INDEX} are missing" if absent else ""
    if (path / "model.safetensors").is_file():
        return ""
    if any(path.glob("*.bin")):
        return "weights only as pickle (*.bin), which this project never loads; no model.safetensors"
    return "no weights (model.safetensors or model.safetensors.index.json)"
