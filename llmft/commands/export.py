"""`llmft export --adapter DIR --output DIR [--merge] [--dtype bf16]`: a servable copy of an adapter.

With ``--merge``: a standalone Hugging Face model directory (the adapter merged into its base,
streamed shard by shard; serve it without ``--enable-lora``). Without: a clean adapter bundle
(adapter config and weights, tokenizer, manifests; no optimizer state). llmft/trainer/export.py does
the work; docs/export.md explains both forms.
"""

from __future__ import annotations

import argparse


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--adapter", required=True, help="PEFT adapter directory: a run's final/, a promoted adapter or a checkpoint"
    )
    parser.add_argument("--output", required=True, help="directory to write (atomically; must be new, empty or ours)")
    parser.add_argument(
        "--merge", action="store_true", help="merge into the base model and write a standalone model directory"
    )
    parser.add_argument(
        "--dtype", default="bf16", help="weights dtype of the merged model: bf16 (default), fp16 or fp32"
    )
    parser.add_argument(
        "--base", default=None, help="base model directory, when the one the adapter records is not reachable here"
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest output safetensors shard (default 5GB; e.g. 500MB)"
    )
    parser.add_argument("--force", action="store_true", help="replace an output directory llmft did not write")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # heavy: torch
    from llmft.trainer.export import export_adapter

    manifest = export_adapter(
        args.adapter,
        args.output,
        merge=args.merge,
        dtype=args.dtype,
        base=args.base,
        max_shard_size=args.max_shard_size,
        force=args.force,
    )
    base = manifest["base_model"]["name_or_path"]
    if manifest["format"] == "merged":
        print(
            f"merged {manifest['merged_modules']} adapted modules of {args.adapter} into {base} "
            f"({manifest['base_storage']}) -> {args.output} ({len(manifest['shards'])} shard(s), "
            f"{manifest['dtype']}); serve it as a plain model, without --enable-lora"
        )
    else:
        print(f"adapter bundle of {args.adapter} (base {base}) -> {args.output}")
    print(f"tokenizer: {manifest['tokenizer_source']}")
    return 0
