"""`llmft data ...`: prepare raw datasets into canonical JSONL; tokenize and pack them into shards."""

from __future__ import annotations

import argparse
import sys

FORMAT_CHOICES = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text")
TRUNCATION_CHOICES = ("drop", "truncate", "error")


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    _add_prepare(sub)
    _add_tokenize(sub)


def _add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="validate and convert a dataset into train/val JSONL (+ rejects.jsonl, report.json)",
        description="Validate and convert a hub dataset or a local .jsonl/.json/.csv/.parquet file or folder "
        "into canonical JSONL. Exit 1 when no row is valid or too many rows are rejected.",
    )
    p.add_argument("--input", required=True, help="hub dataset id, or a local file or folder")
    p.add_argument("--output", required=True, help="directory to write (appears atomically)")
    p.add_argument("--format", default="auto", choices=FORMAT_CHOICES, help="row format (default: detect per row)")
    p.add_argument("--split", default="train", help="split to load from a hub dataset (default: train)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of rows for val.jsonl (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the hash-based train/val split")
    p.add_argument(
        "--max-reject-fraction",
        type=float,
        default=0.01,
        help="fail when more than this share of rows is rejected (default 0.01)",
    )
    p.set_defaults(func=run_prepare)


def _add_tokenize(sub) -> None:
    p = sub.add_parser(
        "tokenize",
        help="chat-template, tokenize, mask, pack and cache a prepared dataset as memory-mapped shards",
        description="Tokenize every split of a `llmft data prepare` directory with the model's tokenizer and "
        "chat template, mask the loss to assistant turns, and best-fit pack documents into --max-length "
        "sequences. A re-run with the same inputs is a cache hit and rewrites nothing.",
    )
    p.add_argument("--input", required=True, help="directory written by `llmft data prepare`")
    p.add_argument("--model", required=True, help="hub model id or local model directory (its tokenizer is used)")
    p.add_argument("--output", required=True, help="directory to write the shards (appears atomically)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per (packed) sequence (default 2048)")
    p.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="best-fit pack documents into sequences (default: on)",
    )
    p.add_argument(
        "--truncation",
        default="drop",
        choices=TRUNCATION_CHOICES,
        help="documents longer than --max-length: drop (default), truncate, or error",
    )
    p.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: CPU count, max 8)")
    p.add_argument(
        "--chat-template",
        default=None,
        help="fallback template when the tokenizer has none: 'chatml', a .jinja file, or Jinja text",
    )
    p.set_defaults(func=run_tokenize)


def _fail(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 1


def run_prepare(args: argparse.Namespace) -> int:
    from llmft.trainer.data.prepare import prepare_dataset
    from llmft.trainer.data.summary import prepare_summary
    from llmft.trainer.errors import LlmftError

    try:
        report = prepare_dataset(
            args.input,
            args.output,
            format=args.format,
            split=args.split,
            val_fraction=args.val_fraction,
            seed=args.seed,
            max_reject_fraction=args.max_reject_fraction,
        )
    except LlmftError as exc:
        return _fail(exc)
    print(prepare_summary(report, args.output))
    return 0


def run_tokenize(args: argparse.Namespace) -> int:
    from llmft.trainer.data.summary import tokenize_summary
    from llmft.trainer.data.tokenize import tokenize_dataset
    from llmft.trainer.errors import LlmftError

    try:
        manifest = tokenize_dataset(
            args.input,
            args.model,
            args.output,
            max_length=args.max_length,
            pack=args.pack,
            truncation=args.truncation,
            num_proc=args.num_proc,
            chat_template=args.chat_template,
        )
    except LlmftError as exc:
        return _fail(exc)
    print(tokenize_summary(manifest, args.output))
    return 0
