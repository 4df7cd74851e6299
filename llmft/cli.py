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
import os
import sys
from importlib.metadata import version

from llmft.trainer.errors import EXIT_CODE_MEANINGS
from llmft.trainer.failures import Teller, describe_failure, missing_package
from llmft.trainer.quiet import quiet_known_noise

# group name -> (module, one-line help). Order is the order shown in --help.
GROUPS: dict[str, tuple[str, str]] = {
    "data": ("llmft.commands.data", "prepare raw datasets into JSONL; tokenize and pack onto shards"),
    "train": ("llmft.commands.train", "run the trainer (one process, or --nproc N through torchrun)"),
    "pipeline": (
        "llmft.commands.pipeline",
        "compile, run locally (kfp.local), submit (and wait for) or schedule the KFP pipeline; render its job; "
        "clean up ended runs",
    ),
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
docs/architecture.md, "Imports"). A package that is missing, at the group's import or later in a command, is one
line naming the extra that brings it (llmft/trainer/failures.py reads it from the installed metadata; these
are named when the metadata does not say, and win where several extras bring it)."""


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_known_noise()  # the libraries' known noise (llmft/trainer/quiet.py): a first run shows what matters
    top = _top_parser()
    if not argv or argv[0] not in GROUPS:
        args = top.parse_args(argv)  # handles --help/--version/unknown group
        top.print_help()
        return 2
    teller = group_teller(argv[0])
    try:
        parser = build_group_parser(argv[0])
    except ModuleNotFoundError as exc:  # a package of an extra; a module of ours missing is a bug: its traceback
        if os.environ.get("LLMFT_DEBUG", "") not in ("", "0") or missing_package(exc, teller) is None:
            raise
        print(f"error: {missing_package(exc, teller)}", file=sys.stderr)
        return 1
    args = parse_group_args(parser, argv[1:])
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return run_command(func, args, teller)


def group_teller(group: str) -> Teller:
    """How a failure of ``llmft <group>`` is told: a missing package names the group and, where setup.cfg's
    metadata does not say, the group's extras."""
    return Teller(command=f"llmft {group}", extras=tuple(GROUP_EXTRAS[group].split(",")))


def run_command(func, args, teller: Teller = Teller()) -> int:
    """Run one sub-command; turn whatever it raises into one line on stderr and its exit code
    (llmft/trainer/failures.py: LlmftError -> its ``exit_code``, a missing package -> 1, an OSError -> 200,
    KeyboardInterrupt -> 130, anything else -> 3, a bug). ``LLMFT_DEBUG=1`` re-raises instead, so the
    traceback shows."""
    try:
        return int(func(args) or 0)
    except BaseException as exc:
        if os.environ.get("LLMFT_DEBUG", "") not in ("", "0") or isinstance(exc, SystemExit | GeneratorExit):
            raise
        code, message = describe_failure(exc, teller)
        print(f"error: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
