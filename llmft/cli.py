"""`llmft`: one command-line tool for the whole workflow.

Each command group lives in ``llmft/commands/<group>.py`` and is imported only
when that group is invoked, so ``llmft --help`` and ``llmft data ...`` never pay
for importing kfp, mlflow or torch they do not need.

A group module exposes ``register(parser)`` (adds its own sub-commands) and each
sub-command sets ``func`` (a callable taking the parsed args and returning an
exit code) via ``parser.set_defaults(func=...)``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from importlib.metadata import version

from llmft.trainer import errors
from llmft.trainer.errors import EXIT_CODE_MEANINGS
from llmft.trainer.storage import describe_disk_fault, describe_path_error, disk_fault, disk_fault_exit_code

# group name -> (module, one-line help). Order is the order shown in --help.
GROUPS: dict[str, tuple[str, str]] = {
    "data": ("llmft.commands.data", "prepare raw datasets into JSONL; tokenize and pack onto shards"),
    "train": ("llmft.commands.train", "run the trainer (one process, or --nproc N through torchrun)"),
    "pipeline": ("llmft.commands.pipeline", "compile, run locally (kfp.local), submit or schedule the KFP pipeline"),
    "sweep": ("llmft.commands.sweep", "Katib hyperparameter sweeps: create, status, best, run-local"),
    "export": ("llmft.commands.export", "merge an adapter into its base model (or bundle it) for serving"),
    "eval": ("llmft.commands.eval", "cache lm-eval tasks' data for offline evaluation on the volume; check a cache"),
    "serve": (
        "llmft.commands.serve",
        "serve an adapter with a real vLLM here, as the InferenceService would; check it",
    ),
    "dev": ("llmft.commands.dev", "developer tools: build the tiny offline model, or write a real pretrained one"),
    "bench": ("llmft.commands.bench", "benchmarks: data preparation and training throughput"),
}


GROUP_EXTRAS: dict[str, str] = {
    "data": "trainer",
    "train": "trainer",
    "pipeline": "pipeline",
    "sweep": "pipeline,katib",
    "export": "trainer",
    "eval": "eval",
    "serve": "pipeline,trainer",
    "dev": "trainer",
    "bench": "trainer",
}
"""The extras of setup.cfg each group's module imports from (its module level may import their light packages:
docs/architecture.md, "Imports"); a group whose package is missing is one line naming them."""


def _epilog() -> str:
    codes = "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODE_MEANINGS.items())
    return (
        "Run `llmft <group> --help` for the sub-commands of a group.\n\n"
        f"Exit codes:\n{codes}\n\n"
        "Every error is one line on stderr; set LLMFT_DEBUG=1 to see the Python traceback instead."
    )


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmft",
        description=(
            "kfp-llm-finetune: raw dataset -> fine-tuned LLM adapter served by KServe + vLLM, as one Kubeflow pipeline."
        ),
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="group", metavar="<group>")
    for name, (_, help_text) in GROUPS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _version() -> str:
    try:
        return version("kfp-llm-finetune")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "0+unknown"


def parse_group_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Options may come after ``key=value`` words (``llmft train lora.r=8 --config f.yaml data=...``):
    intermixed parsing, where the group has no sub-commands (argparse cannot intermix those)."""
    if any(isinstance(action, argparse._SubParsersAction) for action in parser._actions):
        return parser.parse_args(argv)
    return parser.parse_intermixed_args(argv)


def build_group_parser(group: str) -> argparse.ArgumentParser:
    """The full parser of one group, importing only that group's module."""
    module_name, help_text = GROUPS[group]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"llmft {group}", description=help_text)
    module.register(parser)
    return parser


# Loggers whose warnings are noise before a command's one-line result: bitsandbytes (imported by peft) warns at
# import on AVX512-BF16 CPUs that it cannot fetch an optional CPU kernel from a hub (backends/cpu/ops.py).
QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    top = _top_parser()
    if not argv or argv[0] not in GROUPS:
        args = top.parse_args(argv)  # handles --help/--version/unknown group
        top.print_help()
        return 2
    try:
        parser = build_group_parser(argv[0])
    except ModuleNotFoundError as exc:  # a package of an extra; a module of ours missing is a bug: its traceback
        if os.environ.get("LLMFT_DEBUG", "") not in ("", "0") or (exc.name or "llmft").split(".")[0] == "llmft":
            raise
        print(missing_extra(argv[0], exc), file=sys.stderr)
        return 1
    args = parse_group_args(parser, argv[1:])
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return run_command(func, args)


def missing_extra(group: str, exc: ModuleNotFoundError) -> str:
    """The one line for a group whose module needs a package this install lacks (exit 1: the install's
    configuration), naming the extra that brings it."""
    return (
        f"error: llmft {group} needs the Python package {exc.name!r}, which is not installed here; "
        f"install the extra it comes with: pip install 'kfp-llm-finetune[{GROUP_EXTRAS[group]}]'"
    )


def run_command(func, args) -> int:
    """Run one sub-command; turn whatever it raises into one line on stderr and its exit code.

    LlmftError -> its ``exit_code`` (1 bad input, 200 transient); OSError (full or read-only disk,
    I/O error) -> 200; KeyboardInterrupt -> 130; anything else -> 3 (a bug). ``LLMFT_DEBUG=1``
    re-raises instead, so the traceback shows."""
    try:
        return int(func(args) or 0)
    except BaseException as exc:
        if os.environ.get("LLMFT_DEBUG", "") not in ("", "0") or isinstance(exc, SystemExit | GeneratorExit):
            raise
        code, message = describe_failure(exc)
        print(f"error: {message}", file=sys.stderr)
        return code


def describe_failure(exc: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that reached the command line."""

    if isinstance(exc, errors.LlmftError):
        return exc.exit_code, _one_line(str(exc), keep_lines=True)
    if isinstance(exc, KeyboardInterrupt):  # a SignalStop (SIGTERM: 143) says which signal and what was kept
        return getattr(exc, "exit_code", errors.EXIT_INTERRUPTED), _one_line(str(exc)) or "interrupted (Ctrl-C)"
    disk = describe_disk_fault(exc, "the output")  # also safetensors' and torch.save's own errors
    if disk is not None:
        return disk_fault_exit_code(disk_fault(exc) or 0), _one_line(disk)
    bad_path = describe_path_error(exc)  # a 300-character output path: bad input, not an I/O fault
    if bad_path is not None:
        return errors.EXIT_USER_ERROR, bad_path
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        what = exc.strerror or str(exc) or type(exc).__name__
        return errors.EXIT_TRANSIENT, _one_line(
            f"{where}{what} ({type(exc).__name__}, errno {exc.errno}). An I/O fault (full or read-only disk, "
            "permissions, network storage): fix it and re-run; exit 200 is retried by the pipeline"
        )
    return errors.EXIT_INTERNAL, _one_line(
        f"internal error: {type(exc).__name__}: {exc}. This is a bug; re-run with LLMFT_DEBUG=1 for the traceback "
        "and report it"
    )


def _one_line(text: str, *, keep_lines: bool = False) -> str:
    """Messages written as a list of offending lines (prepare's rejects) keep them; others are one line."""
    return text.strip() if keep_lines else " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
