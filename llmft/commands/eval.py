"""`llmft eval`: the evaluate step's lm-eval data, for air-gapped clusters (docs/evaluation.md, "Offline").

* ``llmft eval cache arc_easy mmlu_abstract_algebra --cache DIR`` (a machine with internet and the ``eval`` extra):
  downloads each task's data (a group or tag: every task in it) and writes DIR in the layout the evaluate step
  reads offline (llmft/components/lib/evaluation/eval_cache.py). Copy DIR to ``<data_root>/eval-cache``.
* ``llmft eval check arc_easy --cache DIR``: what the plan step checks, in seconds: every task's files present at
  their recorded size, or one line naming the task, its dataset and the command that caches it.
"""

from __future__ import annotations

import argparse
import os

from llmft.components.lib.evaluation.eval_cache import cache_tasks
from llmft.components.lib.evaluation.task_plan import resolve_task


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    cache = sub.add_parser("cache", help="download lm-eval tasks' data into a folder the evaluate step reads offline")
    cache.add_argument("tasks", nargs="+", help="lm-eval task, group or tag names (arc_easy, mmlu_abstract_algebra)")
    cache.add_argument("--cache", required=True, help="folder to write (then copy it to <data_root>/eval-cache)")
    cache.set_defaults(func=run_cache)
    check = sub.add_parser("check", help="check offline that a cache holds every named task's data (the plan's check)")
    check.add_argument("tasks", nargs="+", help="lm-eval task, group or tag names, heldout, or task YAML paths")
    check.add_argument("--cache", required=True, help="the cache folder (<data_root>/eval-cache)")
    check.set_defaults(func=run_check)


def run_cache(args: argparse.Namespace) -> int:
    for line in cache_tasks(list(args.tasks), args.cache):
        print(line)
    return 0


def run_check(args: argparse.Namespace) -> int:
    for name in args.tasks:
        task = resolve_task(name, args.cache, os.environ)
        where = {"cached": f"cached in {args.cache}", "hub": "not cached: lm-eval fetches it from the reachable hub"}
        metrics = ", ".join(task.metrics) or "known when it runs"
        print(f"{task.label}: {where.get(task.kind, task.kind)}; metrics {metrics}; {task.size} documents")
    return 0
