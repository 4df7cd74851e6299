"""`llmft data ...`: prepare raw datasets into canonical JSONL; tokenize and pack them into shards."""

from __future__ import annotations

import argparse
import signal

# The defaults live in the library (one place); the CLI only shows them. llmft/trainer/data/limits.py imports
# nothing, so `llmft data --help` stays fast.
from llmft.trainer.data.formats import FORMAT_CHOICES
from llmft.trainer.data.limits import DEFAULT_MAX_DROP_FRACTION, DEFAULT_MAX_REJECT_FRACTION, DEFAULT_MAX_ROW_BYTES
from llmft.trainer.data.prepare import prepare_dataset
from llmft.trainer.data.remote import DEFAULT_MAX_FETCH_BYTES
from llmft.trainer.data.summary import prepare_summary, tokenize_summary
from llmft.trainer.data.tokenize import tokenize_dataset
from llmft.trainer.errors import SignalStop

TRUNCATION_CHOICES = ("drop", "truncate", "error")


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    _add_prepare(sub)
    _add_tokenize(sub)


def _add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="validate and convert a dataset into train/val JSONL (+ rejects.jsonl, report.json)",
        description="Validate and convert a hub dataset, a local .jsonl/.json/.csv/.parquet file or folder, such a "
        "file at an https:// URL, s3:// objects (AWS_* credentials and AWS_ENDPOINT_URL from the environment), or a "
        "Langfuse dataset (langfuse://NAME, LANGFUSE_* keys from the environment) into canonical JSONL. Exit 1 "
        "when no row is valid or too many rows are rejected.",
    )
    p.add_argument(
        "--input",
        required=True,
        help="hub dataset id, a local file or folder, https://host/file.jsonl, s3://bucket/key.jsonl or "
        "s3://bucket/prefix/ (every data object under it), or langfuse://NAME",
    )
    _add_output(p)
    p.add_argument("--format", default="auto", choices=FORMAT_CHOICES, help="row format (default: detect per row)")
    p.add_argument(
        "--columns",
        default="",
        metavar="FIELD:COLUMN,...",
        help="read other column names as a format's fields, e.g. prompt:question,completion:answer (fields: "
        "messages; conversations; instruction, input, output, system; prompt, completion; text; role, content "
        "inside turns); the mapped fields name the format",
    )
    p.add_argument("--split", default="train", help="split to load from a hub dataset (default: train)")
    p.add_argument(
        "--hub-config", default="", metavar="NAME", help="configuration (subset) of a hub dataset (default: its own)"
    )
    p.add_argument(
        "--max-fetch-bytes",
        type=int,
        default=DEFAULT_MAX_FETCH_BYTES,
        help="refuse an https:// or s3:// source larger than this (default "
        f"{DEFAULT_MAX_FETCH_BYTES:,} = {DEFAULT_MAX_FETCH_BYTES >> 30} GiB)",
    )
    p.add_argument(
        "--allow-http",
        action="store_true",
        help="accept a plain http:// source (refused by default: rows fetched in clear text can be altered on the "
        "way); a private CA for https: REQUESTS_CA_BUNDLE or SSL_CERT_FILE",
    )
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of rows for val.jsonl (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the hash-based train/val split")
    p.add_argument(
        "--max-reject-fraction",
        type=float,
        default=DEFAULT_MAX_REJECT_FRACTION,
        help=f"fail when more than this share of rows is rejected (default {DEFAULT_MAX_REJECT_FRACTION})",
    )
    p.add_argument(
        "--max-row-bytes",
        type=int,
        default=DEFAULT_MAX_ROW_BYTES,
        help="reject a row larger than this: bytes of a JSONL line (measured while read, never held whole), "
        f"characters of text for other formats (default {DEFAULT_MAX_ROW_BYTES:,} = 8 MiB)",
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
    _add_output(p)
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
        help="documents longer than --max-length: drop (default), truncate (a cut reply stays supervised "
        "without its end-of-turn token), or error",
    )
    p.add_argument(
        "--max-drop-fraction",
        type=float,
        default=DEFAULT_MAX_DROP_FRACTION,
        help="fail (exit 1, with the reasons counted) when more than this share of rows is dropped: too long, "
        f"no trainable token, template errors (default {DEFAULT_MAX_DROP_FRACTION})",
    )
    p.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: CPU count, max 8)")
    p.add_argument(
        "--chat-template",
        default=None,
        help="fallback template when the tokenizer has none: 'chatml', a .jinja file, or Jinja text",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="hub revision (branch, tag or commit) of --model's tokenizer: give the trainer's model.revision",
    )
    p.set_defaults(func=run_tokenize)


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output",
        required=True,
        help="directory to write (appears atomically); an existing one is replaced only when llmft wrote it",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace --output even when it holds files llmft did not write (never the input itself)",
    )


def _stop_cleanly_on_sigterm() -> None:
    """SIGTERM (a pod evicted or preempted) raises in the main thread like Ctrl-C does, so the
    half-written temporary folder is removed and the command exits 143 (retried) with one line."""

    def stop(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
        # A SignalStop is no Exception: no `except Exception` on the way (a template check) takes it for its own
        raise SignalStop(signum, "stopped by SIGTERM; nothing was written (the temporary folder was removed); re-run")

    signal.signal(signal.SIGTERM, stop)


def run_prepare(args: argparse.Namespace) -> int:
    _stop_cleanly_on_sigterm()
    report = prepare_dataset(
        args.input,
        args.output,
        format=args.format,
        split=args.split,
        hub_config=args.hub_config,
        columns=args.columns,
        val_fraction=args.val_fraction,
        seed=args.seed,
        max_reject_fraction=args.max_reject_fraction,
        max_row_bytes=args.max_row_bytes,
        max_fetch_bytes=args.max_fetch_bytes,
        allow_http=args.allow_http,
        force=args.force,
    )
    print(prepare_summary(report, args.output))
    return 0


def run_tokenize(args: argparse.Namespace) -> int:
    _stop_cleanly_on_sigterm()
    manifest = tokenize_dataset(
        args.input,
        args.model,
        args.output,
        max_length=args.max_length,
        pack=args.pack,
        truncation=args.truncation,
        num_proc=args.num_proc,
        chat_template=args.chat_template,
        max_drop_fraction=args.max_drop_fraction,
        force=args.force,
        revision=args.revision,
    )
    print(tokenize_summary(manifest, args.output))
    return 0
