"""Why a job's pods stay Pending, told to the user: their waiting reasons, their unschedulable
condition or their latest Warning event, each with a hint when a known cause matches (the train
step's wait, llmft/components/lib/jobs/pytorchjob_launch.py, prints them every ``every`` polls)."""

from __future__ import annotations

from llmft.components.lib.cluster import ClusterError

PENDING_HINTS = (
    (
        "Insufficient nvidia.com/gpu",
        "no node has enough free GPUs: wait for capacity, or lower gpus_per_worker / "
        "num_workers, or check gpu_node_selector",
    ),
    ("untolerated taint", "the nodes with room are tainted: add a toleration, or check gpu_node_selector"),
    ("didn't match Pod's node affinity/selector", "no node matches gpu_node_selector: check its labels"),
    ("unbound immediate PersistentVolumeClaims", "the PVC is not bound: check pvc_name and its StorageClass"),
    ("persistentvolumeclaim", "the PVC is missing or not bound: check pvc_name"),
    ("ImagePullBackOff", "the trainer image cannot be pulled: check trainer_image and the registry's pull Secret"),
    ("ErrImagePull", "the trainer image cannot be pulled: check trainer_image and the registry's pull Secret"),
    ("CreateContainerConfigError", "a Secret or key the pod reads is missing: create it (the plan step names it)"),
)


def pending_reasons(cluster, selector: str, namespace: str, hints=PENDING_HINTS) -> list[str]:
    """One line per Pending pod: its waiting reason, its unschedulable condition, or its latest
    Warning event, with a hint when a known cause matches (``hints``: (text in the reason, hint) pairs)."""
    lines = []
    for pod in cluster.list_pods(selector, namespace=namespace):
        if pod.status is None or pod.status.phase != "Pending":
            continue
        name, found = pod.metadata.name, []
        for status in pod.status.container_statuses or []:
            waiting = status.state.waiting if status.state else None
            if waiting is not None and waiting.reason not in (None, "ContainerCreating", "PodInitializing"):
                found.append(f"{waiting.reason}: {waiting.message or ''}".strip(": "))
        for condition in pod.status.conditions or []:
            if condition.type == "PodScheduled" and condition.status == "False" and condition.message:
                found.append(f"{condition.reason or 'Unschedulable'}: {condition.message}")
        if not found:
            warnings = [e for e in cluster.list_events(name, namespace=namespace) if e.type == "Warning"]
            found += [f"{e.reason}: {e.message}" for e in warnings[-1:]]
        for text in found:
            hint = next((h for key, h in hints if key in text), "")
            lines.append(f"pod {name} Pending: {text}" + (f" -> {hint}" if hint else ""))
    return lines


class PendingReporter:
    """Called once per poll; every ``every`` polls, prints why the job's pods are Pending (if they are)."""

    def __init__(self, cluster, selector: str, namespace: str, *, every: int, print_fn=print, hints=PENDING_HINTS):
        self.cluster, self.selector, self.namespace, self.hints = cluster, selector, namespace, hints
        self.every, self.print_fn, self.polls = max(1, every), print_fn, 0

    def __call__(self) -> list[str]:

        self.polls += 1
        if self.polls % self.every:
            return []
        try:
            lines = pending_reasons(self.cluster, self.selector, self.namespace, self.hints)
        except ClusterError as exc:
            lines = [f"(could not read why the pods are Pending: {exc})"]
        for line in lines:
            self.print_fn(line)
        return lines
