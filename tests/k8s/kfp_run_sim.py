"""One KFP run's Argo Workflow over its whole life: task attempts and their retries, the exit handler, a
cancel, a run's Retry, as KFP 2.4.1-2.17.0 compiles this project's pipeline and Argo v3.4.17 runs it. The
Workflow and the launcher pods live in the fakes of k8s_fakes.py, so the project's own cleanup code (the
launcher's SIGTERM handler, the exit handler, the janitor) reads them as it would read a cluster's.

Each rule, with its source (kubeflow/pipelines at the tag named; argoproj/argo-workflows at v3.4.17):

* the body of both pipelines is the ``exit-handler-1`` DAG (its node ``<wf>.root.exit-handler-1``); the
  exit task is that DAG task's exit hook, a DAG of its own named ``<wf>.root.exit-handler-1.onExit``
  (2.4.1 ``backend/src/v2/compiler/argocompiler/dag.go`` 55-100; argo ``workflow/controller/exit_handler.go``
  15-47 ``runOnExitNode``, ``common.GenerateOnExitNodeName``);
* a task with ``set_retry`` is a Retry node whose children are the attempts ``<node>(<n>)``, Pod nodes; its
  ``retryStrategy`` has a limit and a backoff but no ``retryPolicy`` (2.16.0 ``argocompiler/container.go``
  655-676; 2.17.0 577-587), so Argo's default OnFailure retries a Failed attempt and not an Error one
  (``operator.go`` 1035-1042): a pod deleted before Argo saw its end is Error "pod deleted" (1144-1176);
* pod names are ``<wf>-<template>-<fnv32a(node name)>`` and node ids ``<wf>-<fnv32a(node name)>``
  (``workflow/util/pod_name.go`` 53-70, POD_NAMES v2, the default); every pod carries the label
  ``workflows.argoproj.io/workflow`` (``workflow/common/common.go`` 75-76) and is controlled by the
  Workflow (``workflowpod.go`` 172-173);
* the exit hook runs once the body's DAG is fulfilled, unless its node exists and is fulfilled: Argo returns a
  fulfilled node as it is (``operator.go`` 1821-1826 ``executeTemplate``/``handleNodeFulfilled``);
* KFP's cancel patches ``activeDeadlineSeconds: 0`` (2.4.1 ``backend/src/common/util/execution_spec.go``
  315-322, the same through 2.17.0); Argo signals the running pods and marks their nodes Failed at once
  (``exec_control.go`` 55-62) and the Workflow ends Failed. Whether the exit hook then runs is not modelled
  as a fact (kubeflow/pipelines#6101 reports "Step exceeded its deadline" for it; ``operator.go`` 1204-1211
  fails nodes still Pending past the deadline): ``cancel(hook_runs=...)`` plays either;
* a run's Retry is ``GenerateRetryExecution`` (2.4.1 ``backend/src/common/util/workflow.go`` 195-250,
  unchanged in 2.17.0), played line by line in :meth:`KfpRun.retry`: Succeeded and Skipped nodes are carried
  over unless named ``<wf>.onExit*`` (so the exit hook's node, ``<wf>.root.exit-handler-1.onExit``, is);
  Failed, Error and Omitted DAG nodes are set Running again; every other failed node is dropped and its pod
  deleted; a deadline of 0 (a cancel) is unset; the Workflow is Running again.

Test choices, not traced: no driver pods and no DAG nodes other than those above; a task's attempts end when
the test says so; backoff and timestamps come from the injected clock.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from kubernetes import client

WORKFLOW_LABEL = "workflows.argoproj.io/workflow"
RUN_LABEL = "pipeline/runid"
BODY = "root.exit-handler-1"
TEMPLATE = "system-container-impl"
FINISHED = ("Succeeded", "Failed", "Error", "Skipped", "Omitted")


def fnv32a(text: str) -> int:
    value = 0x811C9DC5
    for byte in text.encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


class KfpRun:
    """The Workflow of one run in ``custom`` (a FakeCustomObjectsApi), its pods in ``core``."""

    def __init__(self, custom, core, namespace: str, name: str, run_id: str, clock: Callable[[], float]):
        self.custom, self.core, self.namespace, self.name, self.run_id, self.clock = (
            custom, core, namespace, name, run_id, clock
        )  # fmt: skip
        self.hook_runs = 0
        self.key = ("argoproj.io", "v1alpha1", namespace, "workflows", name)
        custom.objects[self.key] = {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": {RUN_LABEL: run_id}},
            "spec": {},
            "status": {"phase": "Running", "startedAt": self._stamp(), "nodes": {}},
        }
        self._node(f"{self.name}.{BODY}", "DAG", "Running")

    # -- the Workflow's nodes -----------------------------------------------------------------------------
    @property
    def workflow(self) -> dict:
        return self.custom.objects[self.key]

    @property
    def nodes(self) -> dict:
        return self.workflow["status"]["nodes"]

    def node_id(self, node_name: str) -> str:
        return f"{self.name}-{fnv32a(node_name)}"

    def pod_name(self, node_name: str) -> str:
        return f"{self.name}-{TEMPLATE}-{fnv32a(node_name)}"

    def node(self, node_name: str) -> dict | None:
        return self.nodes.get(self.node_id(node_name))

    def _node(self, node_name: str, kind: str, phase: str, message: str = "") -> dict:
        node = {"id": self.node_id(node_name), "name": node_name, "displayName": node_name.rsplit(".", 1)[-1],
                "type": kind, "phase": phase, "message": message, "children": []}  # fmt: skip
        self.nodes[node["id"]] = node
        up = node_name[: node_name.rindex("(")] if node_name.endswith(")") else node_name.rsplit(".", 1)[0]
        parent = self.node(up) if up != node_name else None
        if parent is not None and node["id"] not in parent["children"]:
            parent["children"].append(node["id"])
        return node

    def _stamp(self) -> str:
        return datetime.datetime.fromtimestamp(self.clock(), datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    # -- a task's attempts ------------------------------------------------------------------------------
    def attempt(self, task: str) -> str:
        """A new attempt of ``task`` (a Retry node's next child), its launcher pod Running; the pod's name."""
        retry = f"{self.name}.{BODY}.{task}"
        parent = self.node(retry) or self._node(retry, "Retry", "Running")
        parent["phase"] = "Running"
        attempt = f"{retry}({len(parent['children'])})"
        self._node(attempt, "Pod", "Running")
        self._pod(self.pod_name(attempt))
        return self.pod_name(attempt)

    def attempts(self, task: str) -> list[dict]:
        parent = self.node(f"{self.name}.{BODY}.{task}")
        return [self.nodes[c] for c in parent["children"]] if parent else []

    def end_attempt(self, pod: str, phase: str, message: str = "", *, evicted_by_kubelet: bool = False) -> None:
        """The attempt whose pod is ``pod`` ends: Succeeded, Failed (the pod stays, Failed; a kubelet eviction
        gives it reason Evicted and DisruptionTarget) or Error "pod deleted" (the pod is gone)."""
        node = next(n for n in self.nodes.values() if n["type"] == "Pod" and self.pod_name(n["name"]) == pod)
        node.update(phase=phase, message=message)
        if phase == "Error":
            self.core.remove_pod(self.namespace, pod)
            return
        target = next(p for p in self.core.pods[self.namespace] if p.metadata.name == pod)
        target.status.phase = phase
        if evicted_by_kubelet:
            target.status.reason = "Evicted"
            target.status.conditions = [
                client.V1PodCondition(type="DisruptionTarget", status="True", reason="TerminationByKubelet")
            ]

    def retries_left(self, task: str, limit: int) -> bool:
        """Whether Argo starts another attempt (OnFailure: the last one Failed, and fewer than limit + 1 ran)."""
        attempts = self.attempts(task)
        return attempts[-1]["phase"] == "Failed" and len(attempts) < limit + 1

    # -- how the run ends -------------------------------------------------------------------------------
    def fail_task(self, task: str, exit_handler: Callable[[str], None]) -> None:
        """The task's Retry node fails (no retry left): the body fails, the exit hook runs, the run ends."""
        self.node(f"{self.name}.{BODY}.{task}")["phase"] = "Failed"
        self._end_body("Failed", exit_handler)

    def succeed(self, exit_handler: Callable[[str], None]) -> None:
        for node in self.nodes.values():
            if node["phase"] == "Running" and node["type"] != "DAG":
                node["phase"] = "Succeeded"
        self._end_body("Succeeded", exit_handler)

    def _end_body(self, phase: str, exit_handler: Callable[[str], None] | None) -> None:
        self.node(f"{self.name}.{BODY}")["phase"] = phase
        if exit_handler is not None:
            self._run_exit_hook(exit_handler)
        self.workflow["status"].update(phase=phase, finishedAt=self._stamp())

    def _run_exit_hook(self, exit_handler: Callable[[str], None]) -> None:
        hook = f"{self.name}.{BODY}.onExit"
        node = self.node(hook)
        if node is not None and node["phase"] in FINISHED:  # fulfilled: returned as it is, not run again
            return
        node = node or self._node(hook, "DAG", "Running")
        pod_node = self._node(f"{hook}.cleanup-run", "Pod", "Running")
        pod = self.pod_name(pod_node["name"])
        self._pod(pod)
        self.hook_runs += 1
        try:
            exit_handler(pod)
        except Exception as exc:  # noqa: BLE001 - the cleanup task failed: its node and the hook's fail
            pod_node["phase"] = node["phase"] = "Failed"
            pod_node["message"] = str(exc)
            return
        pod_node["phase"] = node["phase"] = "Succeeded"

    def cancel(self, *, hook_runs: bool, exit_handler: Callable[[str], None]) -> None:
        """KFP's cancel: deadline 0; running pod nodes Failed at once; the run ends Failed."""
        self.workflow["spec"]["activeDeadlineSeconds"] = 0
        for node in self.nodes.values():
            if node["phase"] == "Running" and node["type"] == "Pod":
                node.update(phase="Failed", message="Stopped with strategy 'Terminate'")
            elif node["phase"] == "Running" and node["type"] == "Retry":
                node["phase"] = "Failed"
        self._end_body("Failed", exit_handler if hook_runs else None)

    def retry(self) -> None:
        """``GenerateRetryExecution`` (kubeflow/pipelines 2.4.1 backend/src/common/util/workflow.go 195-250)."""
        workflow = self.workflow
        assert workflow["status"]["phase"] in ("Failed", "Error"), "Workflow must be Failed/Error to retry"
        if workflow["spec"].get("activeDeadlineSeconds") == 0:
            del workflow["spec"]["activeDeadlineSeconds"]  # "if it was terminated, unset the deadline"
        on_exit, kept = f"{self.name}.onExit", {}
        for node_id, node in self.nodes.items():
            if node["phase"] in ("Succeeded", "Skipped") and not node["name"].startswith(on_exit):
                kept[node_id] = node
            elif (
                node["phase"] in ("Error", "Failed", "Omitted")
                and node["type"] == "DAG"
                and not node["name"].startswith(on_exit)
            ):
                kept[node_id] = {**node, "phase": "Running", "message": ""}
            elif node["type"] == "Pod":
                self.core.remove_pod(self.namespace, self.pod_name(node["name"]))  # podsToDelete
        for node in kept.values():
            node["children"] = [c for c in node["children"] if c in kept]
        workflow["status"].update(phase="Running", nodes=kept, finishedAt=None)

    # -- pods ---------------------------------------------------------------------------------------------
    def _pod(self, name: str) -> None:
        owner = client.V1OwnerReference(api_version="argoproj.io/v1alpha1", kind="Workflow", name=self.name,
                                        uid=f"uid-{self.name}", controller=True)  # fmt: skip
        start = datetime.datetime.fromtimestamp(self.clock(), datetime.UTC)
        self.core.pods.setdefault(self.namespace, []).append(
            client.V1Pod(
                metadata=client.V1ObjectMeta(
                    name=name, namespace=self.namespace, owner_references=[owner], labels={WORKFLOW_LABEL: self.name}
                ),  # fmt: skip
                spec=client.V1PodSpec(containers=[]),
                status=client.V1PodStatus(phase="Running", conditions=[], start_time=start),
            )
        )
