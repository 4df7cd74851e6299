"""`llmft bench ...`: benchmarks (measured, with committed results; never timed tests)."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "data": (
        "llmft.benchmarks.data_bench",
        "prepare + tokenize generated Alpaca-like rows vs the naive datasets.map path (CPU)",
    ),
    "train": ("llmft.benchmarks.train_bench", "training throughput arms (naive / peer / project) on a GPU"),
    "eval-threads": (
        "llmft.benchmarks.eval_threads",
        "decode, perplexity forwards and a training step on a 2-CPU budget, idle and beside 2 busy processes, by "
        "thread setting (issue 49 item 6)",
    ),
}


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (module_name, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(func=_runner(module_name), _bench_module=module_name)
        # Each benchmark module declares its own flags.
        try:
            importlib.import_module(module_name).add_arguments(p)
        except ModuleNotFoundError as exc:  # the benchmark's optional deps are missing
            p.set_defaults(func=_missing(name, exc))


def _runner(module_name: str):
    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(module_name).run(args) or 0)

    return run


def _missing(name: str, exc: Exception):
    def run(_args: argparse.Namespace) -> int:
        print(f"llmft bench {name}: cannot run here ({exc})")
        return 1

    return run
