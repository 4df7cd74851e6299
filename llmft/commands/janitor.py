"""`llmft pipeline janitor`: delete the jobs of runs that have ended (one pass; deploy/janitor.yaml runs it
every 2 minutes as a CronJob of the namespace). The rules: llmft/components/lib/jobs/orphans.py."""

from __future__ import annotations

import argparse

from llmft.components.lib.cluster import Cluster
from llmft.components.lib.jobs.orphans import KEEP_FOR_RETRY_S, sweep_orphans
from llmft.katib.k8s_names import check_k8s_name
from llmft.trainer.errors import ConfigError, TransientError


def add_parser(sub) -> None:
    janitor = sub.add_parser(
        "janitor",
        help="delete the unfinished jobs and Experiments of runs that have ended (the CronJob of deploy/janitor.yaml)",
    )
    janitor.add_argument("--namespace", default=None, help="namespace to sweep (default: this pod's, or kubeconfig's)")
    janitor.add_argument(
        "--keep-for-retry-s",
        type=int,
        default=KEEP_FOR_RETRY_S,
        help=f"how long after its run ended a job kept for the run's Retry lives on (default {KEEP_FOR_RETRY_S})",
    )
    janitor.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    janitor.set_defaults(func=run_janitor)


def run_janitor(args: argparse.Namespace) -> int:
    if args.namespace:
        check_k8s_name(args.namespace, "--namespace")
    if args.keep_for_retry_s < 0:
        raise ConfigError(f"--keep-for-retry-s {args.keep_for_retry_s}: must be >= 0")
    done = sweep_orphans(Cluster(args.namespace), keep_for_retry_s=args.keep_for_retry_s, dry_run=args.dry_run)
    print(f"janitor: {len(done.deleted)} deleted, {len(done.kept)} kept unfinished")
    if done.problems:
        raise TransientError("janitor: " + "; ".join(done.problems) + " (the next pass tries again)")
    return 0
