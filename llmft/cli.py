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
import sys

# group name -> (module, one-line help). Order is the order shown in --help.
GROUPS: dict[str, tuple[str, str]] = {
    "data": ("llmft.commands.data", "prepare raw datasets into JSONL; tokenize and pack onto shards"),
    "train": ("llmft.commands.train", "run the trainer (one process, or --nproc N through torchrun)"),
    "pipeline": ("llmft.commands.pipeline", "compile, run locally (kfp.local), submit or schedule the KFP pipeline"),
    "sweep": ("llmft.commands.sweep", "Katib hyperparameter sweeps: create, status, best, run-local"),
    "dev": ("llmft.commands.dev", "developer tools: build the tiny offline model"),
    "bench": ("llmft.commands.bench", "benchmarks: data preparation and training throughput"),
}

EPILOG = "Run `llmft <group> --help` for the sub-commands of a group. Exit codes: 0 ok, 1 bad input or config, 2 usage."


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmft",
        description=(
            "kfp-llm-finetune: raw dataset -> fine-tuned LLM adapter served by KServe + vLLM, as one Kubeflow pipeline."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="group", metavar="<group>")
    for name, (_, help_text) in GROUPS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kfp-llm-finetune")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "0+unknown"


def build_group_parser(group: str) -> argparse.ArgumentParser:
    """The full parser of one group, importing only that group's module."""
    module_name, help_text = GROUPS[group]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"llmft {group}", description=help_text)
    module.register(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] not in GROUPS:
        args = top.parse_args(argv)  # handles --help/--version/unknown group
        top.print_help()
        return 2
    parser = build_group_parser(argv[0])
    args = parser.parse_args(argv[1:])
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except Exception as exc:  # noqa: BLE001 - user errors print cleanly, others re-raise
        if _is_user_error(exc):
            print(f"error: {exc}", file=sys.stderr)
            return 1
        raise


def _is_user_error(exc: BaseException) -> bool:
    """A trainer.errors.LlmftError (bad config or data): message only, exit 1."""
    errors = sys.modules.get("llmft.trainer.errors")
    return errors is not None and isinstance(exc, errors.LlmftError)


if __name__ == "__main__":
    sys.exit(main())
