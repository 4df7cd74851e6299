"""Follow the trainer's PyTorchJob: print its master pod's log as the train step waits.

Split from llmft/components/lib/jobs/pytorchjob_spec.py (which builds and validates the job);
llmft/components/lib/jobs/pytorchjob_launch.py calls a :class:`MasterLogFollower` once per poll.
The trainer's ``progress:`` lines (llmft/trainer/progress.py) are thinned to the newest one of each
poll (:func:`newest_progress_only`; the TrainJob backend's follower does the same), so the train
task's log in the KFP UI shows where training stands at most once a poll (30 s by default), with
its total and ETA, however fast the steps are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmft.components.lib.cluster import PYTORCHJOB_CONTAINER, Cluster, ClusterError
from llmft.components.lib.jobs.pytorchjob_spec import JOB_NAME_LABEL, JOB_ROLE_LABEL
from llmft.trainer.progress import parse_line


def newest_progress_only(lines: list[str]) -> list[str]:
    """``lines`` with every ``progress:`` line but the last one dropped (the other lines, in order)."""
    progress = [i for i, line in enumerate(lines) if parse_line(line) is not None]
    dropped = set(progress[:-1])
    return [line for i, line in enumerate(lines) if i not in dropped]


class MasterLogFollower:
    """Prints the new lines of the master pod's log each time it is called (once per poll of the
    wait), reading through the Cluster. A pod recreated under the same name (a restart under
    ``restartPolicy: ExitCode``) has a new uid and a fresh log, printed from its start."""

    def __init__(self, cluster: Cluster, name: str, namespace: str, print_fn: Callable[[str], Any] = print):
        self.cluster, self.name, self.namespace, self.print_fn = cluster, name, namespace, print_fn
        self.lines_seen: dict[str, int] = {}

    def __call__(self, job: Any = None) -> None:
        selector = f"{JOB_NAME_LABEL}={self.name},{JOB_ROLE_LABEL}=master"
        try:
            pods = self.cluster.list_pods(selector, namespace=self.namespace)
        except ClusterError:
            return
        for pod in pods:
            pod_name = pod.metadata.name
            if pod.status is not None and pod.status.phase == "Pending":
                continue
            try:
                lines = self.cluster.read_pod_log(
                    pod_name, container=PYTORCHJOB_CONTAINER, namespace=self.namespace
                ).splitlines()
            except ClusterError:  # container not started yet
                continue
            key = f"{pod_name}/{pod.metadata.uid or ''}"
            start = self.lines_seen.get(key, 0)
            start = 0 if len(lines) < start else start  # the container restarted in place: a fresh log
            for line in newest_progress_only(lines[start:]):
                self.print_fn(f"[{pod_name}] {line}")
            self.lines_seen[key] = len(lines)
