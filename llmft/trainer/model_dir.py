"""A local base-model directory is checked before any data is tokenized (so before any GPU time).

:func:`check_model_dir` looks at the files only, not what they hold: ``config.json``, safetensors weights
(``model.safetensors``, or the shards a ``model.safetensors.index.json`` names, each whole by its header and
size: :func:`check_model_files`, which every load of a base or an adapter runs too) and a fast tokenizer
(``tokenizer.json``). A missing or damaged piece is a one-line :class:`~llmft.trainer.errors.DataError`
naming the directory and the fix, where otherwise tokenizing would succeed and the train step would fail
minutes later. The pipeline's tokenize step calls it first (llmft/components/lib/plan/tokenized.py); a
missing chat template is the tokenizer's own check (:func:`llmft.trainer.data.templates.missing_template_error`),
also before any row is tokenized. A hub id (no such local directory) is not checked here: the loaders report it.

:func:`content_hash` identifies a local base model's files (the run manifest records it; export and the
FP8 dequantized copy check against it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from llmft.trainer.checkpoint_check import Corrupt, safetensors_problem
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
    check_model_files(path)
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


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the model directory ``path``: the shards its index names, else model.safetensors."""
    index = path / WEIGHTS_INDEX
    if index.is_file():
        try:
            return [path / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError, AttributeError, TypeError):
            return []  # missing_weights says what is wrong with the index
    return [path / "model.safetensors"] if (path / "model.safetensors").is_file() else []


LOADED_JSON = (
    "config.json",
    "generation_config.json",
    WEIGHTS_INDEX,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "adapter_config.json",
)
"""The JSON files transformers and PEFT read from a model or adapter folder (another JSON file there is not ours
to judge: it may be anything, and no load reads it)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DAMAGED_FIX = {
    "model": f"copy or download the model again, or {FIX_WRITE}",
    "adapter": "copy it again from where it came from (its run's checkpoints/step-N or final/), or train it again",
}


def check_model_files(folder: str | os.PathLike, *, what: str = "model") -> None:
    """The one rule for damaged model files, applied before any load (train, ``export --merge``, the evaluate
    step's base and every adapter, the tokenize step's model check): a one-line DataError naming the first file
    of the local model (``what="model"``) or adapter (``"adapter"``) folder that cannot be whole: a JSON file a
    loader reads (:data:`LOADED_JSON`) that does not parse, or a weight file truncated (a full disk, a copy cut
    short) or with a corrupt header, told from its header and size. safetensors' own error is an internal one
    deep in the load, and a hash check would call a damaged base another model. A hub id is left to the loader."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return
    for name in LOADED_JSON:
        problem = _json_problem(path / name)
        if problem:
            raise DataError(f"{what} {folder}: {problem}: the {what}'s files are damaged. Fix: {DAMAGED_FIX[what]}")
    adapter = [path / ADAPTER_WEIGHTS] if (path / ADAPTER_WEIGHTS).is_file() else []
    for file in weight_files(path) + adapter:
        try:
            safetensors_problem(file)
        except Corrupt as exc:
            raise DataError(
                f"{what} {folder}: {exc}: the {what}'s weights are damaged. Fix: {DAMAGED_FIX[what]}"
            ) from None


def _json_problem(file: Path) -> str:
    """'' when ``file`` is absent or parses as JSON, else what is wrong with it (naming it)."""
    if not file.is_file():
        return ""
    try:
        json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"{file}: not JSON ({' '.join(str(exc).split())[:120]})"
    return ""


def content_hash(directory: Path, full_limit: int = 2 << 30) -> tuple[str, str]:
    """sha256 over config + weight files; above ``full_limit`` bytes, over each file's size,
    safetensors header and first/last MiB (a fingerprint, named as such)."""
    files = sorted(p for p in directory.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    total = sum(p.stat().st_size for p in files)
    method = "sha256" if total <= full_limit else "sha256-fingerprint(size,header,head,tail)"
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as fh:
            if method == "sha256":
                while block := fh.read(1 << 20):
                    h.update(block)
            else:
                _fingerprint(fh, path, h)
    return h.hexdigest(), method


def _fingerprint(fh, path: Path, h) -> None:
    size = os.fstat(fh.fileno()).st_size
    h.update(str(size).encode())
    h.update(fh.read(1 << 20))
    fh.seek(max(0, size - (1 << 20)))
    h.update(fh.read(1 << 20))
