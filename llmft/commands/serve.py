"""`llmft serve ...`: serve an adapter with a real vLLM on this machine, as the InferenceService would."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmft.components.lib.contracts.choices import SERVING_MODES
from llmft.components.lib.serving.serve_check import check_result_target, serve_check
from llmft.trainer.io import atomic_write_json, check_owned_file


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    check = sub.add_parser(
        "check",
        help="start a real vLLM OpenAI server (from `make serving-venv`) with the InferenceService's own arguments, "
        "smoke-test it (every served name listed, the adapter's greedy answer differs from the base's), stop it",
        description="Serve --adapter with the served names, LoRA module, max LoRA rank, dtype and max model length "
        "the deploy step's InferenceService carries (base as NAME-base + adapter as NAME; a merged form as NAME "
        "alone), on 127.0.0.1, from the serving virtualenv (make serving-venv; LLMFT_SERVING_VENV). Exit 1 with "
        "vLLM's own reason when it refuses the adapter, the model or the port.",
    )
    check.add_argument(
        "--adapter", required=True, help="the PEFT adapter directory (adapter_config.json + safetensors)"
    )
    check.add_argument("--name", required=True, help="served name of the adapter (the base is served as NAME-base)")
    check.add_argument("--prompt", required=True, help="the user message both models answer (chat template)")
    check.add_argument("--json", help="write {'models': [...], 'answers': {name: text}} here")
    check.add_argument("--base", help="base model directory (default: the adapter's base_model_name_or_path)")
    check.add_argument(
        "--serving-mode",
        choices=SERVING_MODES,
        default="lora",
        help="as the pipeline's serving_mode: lora (default: an adapter vLLM refuses is an error), merged (serve "
        "the adapter merged into its base, alone as NAME), auto (merged only when vLLM refuses the LoRA form)",
    )
    check.add_argument("--merged-dir", help="where the merged form is written (default: a temporary directory)")
    check.add_argument("--max-lora-rank", type=int, help="vLLM --max-lora-rank (default: the InferenceService's)")
    check.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default 0: a free one)")
    check.add_argument(
        "--log", help="vLLM's log file: new, or one llmft wrote (default: a temporary file, named when vLLM fails)"
    )
    check.add_argument(
        "--force", action="store_true", help="replace a file (or symlink) at --log that llmft did not write"
    )
    check.add_argument("--max-tokens", type=int, default=32, help="greedy answer length in tokens (32)")
    check.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for the server to answer (900)"
    )
    check.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:

    if args.json:
        check_result_target(Path(args.json))
    if args.log:
        check_owned_file(args.log, force=args.force)  # the log is streamed, so never written through a symlink:
        if Path(args.log).is_symlink():  # with --force the link itself goes, never its target
            Path(args.log).unlink()
    options = {"port": args.port, "log_path": args.log, "startup_timeout_s": args.startup_timeout}
    result = serve_check(
        args.adapter,
        args.name,
        args.prompt,
        base=args.base,
        serving_mode=args.serving_mode,
        max_lora_rank=args.max_lora_rank,
        merged_dir=args.merged_dir,
        server_options=options,
        max_tokens=args.max_tokens,
    )
    print(f"served models: {', '.join(result['models'])}")
    for name, text in result["answers"].items():
        print(f"{name}: {text!r}")
    if args.json:
        atomic_write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
