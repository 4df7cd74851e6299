"""A small controller simulator: what a real cluster does to this project's jobs, with real local
processes (`llmft train` on the tiny model) as the pods' containers.

No real cluster can run here. The fakes of k8s_fakes.py stand in for the API server; this module
plays the controllers behind it, each rule following the upstream source it cites:

* Training Operator v1 (kubeflow/trainer v1.9.4), :class:`ClusterSim` for PyTorchJobs:
  - pods ``<job>-master-0`` / ``<job>-worker-<i>`` with the rendezvous environment of
    ``pkg/controller.v1/pytorch/envvar.go`` 50-127 (MASTER_ADDR is 127.0.0.1 here, not the master's
    Service, and the port a free one);
  - ``restartPolicy: ExitCode``: a pod that exits 128-255 is deleted and created again (so its
    restartCount stays 0), 1-127 fails the job (``pkg/util/train/train_util.go`` 24-26,
    ``pkg/controller.v1/common/pod.go`` 339-373); backoffLimit counts restartCount of running pods
    only (``pkg/core/job.go`` 93-133), which recreated pods never raise (kubeflow/trainer#2045);
  - ``activeDeadlineSeconds`` from status.startTime (``pkg/core/job.go`` 81-91) fails the job with
    the message of ``pkg/controller.v1/common/job.go`` 211-213; conditions as
    ``pkg/controller.v1/pytorch/pytorchjob_controller.go`` 358-444 sets them (Running while the
    master runs, Succeeded when it succeeded) and ``pkg/util/status.go`` 103-107 freezes them once
    Failed;
  - ``cleanPodPolicy`` on a finished job (``pkg/controller.v1/common/job.go`` 43-69): None keeps
    every pod, Running deletes the Running and Pending ones, All deletes all;
  - a pod whose container never ran gets exit code 0xbeef and is recreated (``pod.go`` 339-366;
    ``ClusterSim.never_start`` makes pods fail before start, as a kubelet admission error does);
  - pods are owned by their job (``job_controller.go`` 222-233, blockOwnerDeletion); deleting a job
    deletes its pods: with background propagation the job goes at once, with foreground it stays
    (``deletionTimestamp``) until its pods are gone (kubernetes.io/docs/concepts/architecture/
    garbage-collection); a new job's pod whose name an old, terminating pod still holds is not
    created (AlreadyExists; ``ClusterSim.collisions``).
* KFP 2.4/2.5 and Argo v3.4.17 (``ClusterSim.kfp_launcher``): the launcher pod owned by its Workflow;
  cancel (``activeDeadlineSeconds`` 0), ``spec.shutdown``, the Workflow's deadline and an eviction
  (``DisruptionTarget`` condition) each end in SIGTERM to the launcher, which is the test's process.
* Kubelet and container runtime: deleting a pod sends SIGTERM to the container's main process and
  SIGKILL after ``terminationGracePeriodSeconds`` (default 30 s), the pod staying in the API
  (Terminating) until its container has ended; when the main process exits, every
  other process of the container dies too (the kernel ends a PID namespace with its init; with a
  shared one, containerd's runc shim kills them, ``ShouldKillAllOnExit``); ``$(VAR)`` and ``$$`` in
  command and args are expanded from the container's env (k8s.io/kubernetes
  ``third_party/forked/golang/expansion``). A container's main process here is a plain child process
  (as with ``shareProcessNamespace``, which Katib sets on trial pods); a pod's own PID namespace,
  where an unhandled SIGTERM to PID 1 is ignored, is not reproduced: the trainer's launchers handle
  SIGTERM themselves. Unschedulable pods (no free ``nvidia.com/gpu``), a missing PVC or Secret key
  and an image that cannot be pulled stay Pending with the waiting reason, condition and event the
  scheduler and kubelet write.
* Katib v0.19.0 (:func:`katib_wrap`): the metrics-collector wrapper of a trial's primary container
  (``pkg/webhook/v1beta1/pod/utils.go`` 155-221), the webhook's walk from a pod to its Trial
  (:func:`katib_mutates`, ``inject_webhook.go`` 110-166, 255-300) and the collector's early stop
  (``cmd/metricscollector/v1beta1/file-metricscollector/main.go`` 263-296); Experiments go Running.
* KServe v0.20.0 (:class:`FakeVllm`): an InferenceService turns Ready with a URL (Ready condition
  plus ``status.url``: ``pkg/apis/serving/v1beta1/inference_service_status.go`` 306-309); its
  predictor is the Hugging Face runtime's OpenAI server as KServe's own code answers: the model is
  registered under ``--model_name`` and every ``--lora-modules`` name (huggingfaceserver
  ``__main__.py`` 332-336; none before v0.15.1, ``FakeVllm(registers_lora_names=False)``), the listing
  gives the base name once per registered name (``openai/endpoints.py`` 229-249), an unregistered name
  is answered 404 (``protocol/dataplane.py`` ``get_model``, ``errors.py`` ``ModelNotFound``), and vLLM
  resolves a request's model name against the base names first (``OpenAIServing._maybe_get_adapter``,
  as bundled with KServe 0.15/0.16) and answers under the name asked (the LoRA name:
  ``vllm/entrypoints/openai/completion/serving.py`` ``models.model_name(lora_request)``), with the real
  tiny model and adapter through transformers. tests/serving/test_kserve_openai.py runs KServe's own
  code for the same rules (the listing there, here encoded).
  Not traced to source (test choices): the URL ``http://<name>.<namespace>.example.com`` and Ready at the
  first reconcile (no predictor pod, no model load time).

Not traced to source anywhere above (test choices; no test claims them of a cluster): the controllers
reconcile on every read of the API (``before_read``), not on watch events; a pod's container starts at
once (no image pull, scheduling or init time); free GPUs are counted for the namespace (``gpus``), not per
node; a Katib Experiment goes Running with the reason ``ExperimentRunning`` of Katib's
``status_util.go`` but the message ``running``, and no suggestion service creates trials (the tests
create the trial jobs).
"""

from __future__ import annotations

import calendar
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kubernetes import client

JOB_NAME_LABEL = "training.kubeflow.org/job-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"
POD_TAG = "LLMFT_SIM_POD_UID"
"""Every process of a simulated container carries this variable: the simulator's stand-in for a cgroup."""
DEADLINE_MESSAGE = "Job {} has failed because it was active longer than specified deadline"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def now_rfc3339(ts: float | None = None) -> str:
    """``ts`` (default: the machine's time) as Kubernetes writes a timestamp."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if ts is None else ts))


def parse_rfc3339(stamp: str) -> float:
    return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))


def condition(kind: str, reason: str, message: str, status: str = "True", stamp: str | None = None) -> dict:
    stamp = stamp or now_rfc3339()
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastUpdateTime": stamp,
        "lastTransitionTime": stamp,
    }


def set_condition(status: dict, new: dict) -> None:
    """pkg/util/status.go 103-148: frozen once Failed; Running and Restarting exclude each other;
    Failed/Succeeded set Running to False."""
    conditions = status.setdefault("conditions", [])
    if any(c["type"] == "Failed" and c["status"] == "True" for c in conditions):
        return
    current = next((c for c in conditions if c["type"] == new["type"]), None)
    if current and current["status"] == new["status"] and current["reason"] == new["reason"]:
        return
    exclusive = {"Running": "Restarting", "Restarting": "Running"}
    kept = [c for c in conditions if c["type"] not in (new["type"], exclusive.get(new["type"]))]
    for c in kept:
        if new["type"] in ("Failed", "Succeeded") and c["type"] == "Running":
            c["status"] = "False"
    status["conditions"] = [*kept, new]


def _owner_uid(pod) -> str | None:
    owners = pod.metadata.owner_references or []
    return next((o.uid for o in owners if o.controller), None)


def is_finished(obj: dict) -> bool:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] in ("Succeeded", "Failed") and c["status"] == "True" for c in conditions)


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of command, args and env values (third_party/forked/golang/expansion
    ``Expand`` / ``tryReadVariableName``): ``$$`` -> ``$``; ``$(...)`` up to the next ``)`` -> the
    variable's value, or left as written when no such variable is defined (so ``$(head ...)`` in a
    shell script passes through, ``$$`` inside it included)."""
    out, cursor = [], 0
    while cursor < len(text):
        if text[cursor] != "$" or cursor + 1 == len(text):
            out.append(text[cursor])
            cursor += 1
            continue
        rest = text[cursor + 1 :]
        if rest[0] == "$":
            out.append("$")
            cursor += 2
        elif rest[0] == "(" and ")" in rest:
            name = rest[1 : rest.index(")")]
            out.append(env[name] if name in env else f"$({name})")
            cursor += len(name) + 3
        else:
            out.append("$" + rest[0])
            cursor += 2
    return "".join(out)


# --- containers as local processes ----------------------------------------------------------------


def tagged_pids(uid: str) -> list[int]:
    """Processes whose environment carries ``POD_TAG=uid`` (every process of one container)."""
    needle = f"{POD_TAG}={uid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@dataclass
class Container:
    """One run of a pod's container: a local process (its main process) and everything it starts."""

    pod: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    proc: subprocess.Popen | None = None

    def start(self, cwd: Path) -> Container:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env={**self.env, POD_TAG: self.uid},
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def exit_code(self) -> int | None:
        """None while running; a signal's death is 128 + its number, as the runtime reports it."""
        code = self.proc.poll()
        if code is None:
            return None
        self.kill_all()  # the container ends with its main process
        return 128 - code if code < 0 else code

    def signal(self, signum: int) -> None:
        """What the runtime does on stop: the signal to the container's main process only."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def kill_all(self) -> None:
        """SIGKILL every process of the container (OOM kill, node loss, end of the grace period)."""
        for pid in tagged_pids(self.uid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


def base_env(**extra: str) -> dict[str, str]:
    """The environment every simulated container starts from: this test's, without anything a pod
    would not have (LLMFT_*, MLFLOW_*, LANGFUSE_*, rendezvous variables), offline, one thread."""
    drop = ("MLFLOW_", "LANGFUSE_", "LLMFT_", "PET_", "KFP_")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(drop) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `llmft` on PATH
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **extra})
    return env


# --- the cluster ----------------------------------------------------------------------------------


@dataclass
class Chaos:
    """Send ``signum`` to the containers of pods whose name starts with ``pod_prefix`` once their log
    (or the log of pod ``watch``: only rank 0 prints training steps) contains ``when``. SIGKILL hits
    the whole container, like an OOM kill or a lost node."""

    pod_prefix: str
    when: str
    signum: int = signal.SIGKILL
    times: int | None = None  # None: every run of the pod
    watch: str | None = None
    hit: set = field(default_factory=set)  # containers already hit


class ClusterSim:
    """Controllers of one namespace over the fakes: the Training Operator for PyTorchJobs, Katib
    Experiments going Running, KServe InferenceServices turning Ready (see the module docstring)."""

    def __init__(self, custom, core, namespace: str, workdir: Path, *, volumes=None, secrets=None, gpus=None,
                 clock: Callable[[], float] = time.time):  # fmt: skip
        self.custom, self.core, self.namespace, self.workdir = custom, core, namespace, Path(workdir)
        self.clock = clock  # the controllers' wall clock: startTime, deadlines, deletion and condition stamps
        self.volumes: dict[str, Path] = {k: Path(v) for k, v in (volumes or {}).items()}
        self.secrets: dict[str, dict[str, str]] = dict(secrets or {})
        self.gpus = gpus  # free nvidia.com/gpu in the cluster (None: as many as asked)
        self.unpullable: set[str] = set()
        self.grace_s = 30.0
        self.chaos: list[Chaos] = []
        self.containers: dict[str, Container] = {}
        self.terminating: list[tuple[Container, float]] = []
        self.history: list[tuple[str, int]] = []  # (pod, exit code) of every container that ended
        self.started: list[str] = []  # the pod of every container started, in order
        self.never_start: dict[str, tuple[str, str]] = {}  # pod name prefix -> (reason, message) of a pod that
        # fails before its container runs (kubelet admission: UnexpectedAdmissionError for a GPU it cannot allocate)
        self.collisions: list[str] = []  # pods a new job could not create: an old one of that name still terminating
        self.ports: dict[str, int] = {}
        self.servers: dict[str, FakeVllm] = {}
        self.katib: dict | None = None  # {"early_stopping": bool, "metrics_file": Path}: Masters are Katib trials
        self._lock = threading.RLock()
        custom.before_read, custom.on_delete, core.before_read = self.reconcile, self.on_delete, self.refresh
        custom.dependents = self.dependents
        self.workdir.mkdir(parents=True, exist_ok=True)

    # -- the API objects ---------------------------------------------------------------------------
    def objects(self, plural: str) -> list[dict]:
        return [o for (_, _, ns, p, _), o in list(self.custom.objects.items()) if p == plural and ns == self.namespace]

    def pods(self, job: str | None = None) -> list:
        pods = self.core.pods.get(self.namespace, [])
        return [p for p in pods if job is None or (p.metadata.labels or {}).get(JOB_NAME_LABEL) == job]

    def running(self) -> list[str]:
        """Pods whose container still runs, terminating ones included (what holds GPUs)."""
        with self._lock:
            live = [c.pod for c in self.containers.values() if c.proc.poll() is None]
            return live + [c.pod for c, _ in self.terminating if c.proc.poll() is None]

    def wait_for_log(self, pod: str, text: str, timeout_s: float = 180.0) -> Container:
        """Reconcile until the running container of ``pod`` has logged ``text``; returns it."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.reconcile()
            container = self.containers.get(pod)
            if container is not None and text in container.text():
                return container
            assert time.monotonic() < deadline, f"{pod} did not log {text!r} within {timeout_s:.0f}s"
            time.sleep(0.2)

    # -- reconcile loop, driven by every read of the API ------------------------------------------------
    def reconcile(self) -> None:
        with self._lock:
            self.refresh()
            for job in self.objects("pytorchjobs"):
                self._reconcile_job(job)
            for experiment in self.objects("experiments"):
                if not (experiment.get("status") or {}).get("conditions"):
                    experiment["status"] = {"conditions": [self.condition("Running", "ExperimentRunning", "running")]}
            for isvc in self.objects("inferenceservices"):
                self._reconcile_isvc(isvc)

    def refresh(self) -> None:
        """Pod statuses from their processes; chaos; the end of terminating containers."""
        with self._lock:
            for name, container in list(self.containers.items()):
                self._apply_chaos(container)
                code = container.exit_code()
                if code is not None and self._pod(name) is not None and self._pod(name).status.phase == "Running":
                    self.history.append((name, code))
                    self._set_terminated(self._pod(name), code)
            for container, deadline in list(self.terminating):
                if container.proc.poll() is not None or time.monotonic() > deadline:
                    container.kill_all()
                    self.terminating.remove((container, deadline))
                    self.core.remove_pod(self.namespace, container.pod)  # the kubelet confirmed: gone from the API

    def _apply_chaos(self, container: Container) -> None:
        for rule in self.chaos:
            if not container.pod.startswith(rule.pod_prefix) or container.uid in rule.hit:
                continue
            if rule.times is not None and len(rule.hit) >= rule.times:
                continue
            watched = self.containers.get(rule.watch) if rule.watch else container
            if container.proc.poll() is None and watched is not None and rule.when in watched.text():
                rule.hit.add(container.uid)
                if rule.signum == signal.SIGKILL:
                    container.kill_all()
                else:
                    container.signal(rule.signum)

    def _pod(self, name: str):
        return next((p for p in self.pods() if p.metadata.name == name), None)

    def _key(self, plural: str, name: str) -> tuple:
        group, version = {"pytorchjobs": ("kubeflow.org", "v1")}[plural]
        return (group, version, self.namespace, plural, name)

    # -- the Training Operator ---------------------------------------------------------------------
    def _reconcile_job(self, job: dict) -> None:
        name, status = job["metadata"]["name"], job.setdefault("status", {})
        if job["metadata"].get("deletionTimestamp"):  # pytorchjob_controller.go 149: a deleting job is not synced
            if not [p for p in self.pods(name) if _owner_uid(p) == job["metadata"]["uid"]]:
                self.custom.objects.pop(self._key("pytorchjobs", name), None)  # the GC drops foregroundDeletion
            return
        policy = (job["spec"].get("runPolicy") or {}).get("cleanPodPolicy") or "None"
        if is_finished(job):
            self._clean_pods(name, policy)
            return
        if "startTime" not in status:
            # the port first: a SIGTERM test's handler re-enters this reconcile (RLock, same thread) between
            # any two lines, and a job with a startTime must have its port
            self.ports[name] = free_port()
            status["startTime"] = self.stamp()
            set_condition(status, self.condition("Created", "PyTorchJobCreated", f"PyTorchJob {name} is created."))
        deadline = (job["spec"].get("runPolicy") or {}).get("activeDeadlineSeconds")
        started = parse_rfc3339(status["startTime"])
        if deadline is not None and self.clock() - started >= deadline:
            set_condition(status, self.condition("Failed", "PyTorchJobFailed", DEADLINE_MESSAGE.format(name)))
            status["completionTime"] = self.stamp()
            self._clean_pods(name, policy)
            return
        replicas = job["spec"]["pytorchReplicaSpecs"]
        for rtype, rspec in replicas.items():
            for index in range(rspec.get("replicas", 1)):
                self._reconcile_pod(job, rtype, index, rspec)
        master = self._pod(f"{name}-master-0")
        if master is not None and master.status.phase == "Running":
            set_condition(status, self.condition("Running", "PyTorchJobRunning", f"PyTorchJob {name} is running."))
        if master is not None and master.status.phase == "Succeeded":
            set_condition(
                status,
                self.condition("Succeeded", "PyTorchJobSucceeded", f"PyTorchJob {name} is successfully completed."),
            )
            status["completionTime"] = self.stamp()
        if is_finished(job):
            self._clean_pods(name, policy)

    def _reconcile_pod(self, job: dict, rtype: str, index: int, rspec: dict) -> None:
        name = job["metadata"]["name"]
        pod_name = f"{name}-{rtype.lower()}-{index}"
        pod = self._pod(pod_name)
        if pod is None:
            self._create_pod(job, rtype, index, rspec)
            return
        if _owner_uid(pod) != job["metadata"]["uid"]:  # an earlier job's pod, still terminating
            self.collisions.append(pod_name)  # the operator's create fails: pods "<name>" already exists
            self.core.add_event(self.namespace, name, "FailedCreatePod", f'pods "{pod_name}" already exists')
            return
        if pod.status.phase != "Failed":
            return
        code = 0xBEEF  # pod.go 339-348: a container that never ran has this magic exit code (retryable)
        for status in pod.status.container_statuses or []:
            if status.state is not None and status.state.terminated is not None:
                code = status.state.terminated.exit_code
        if rspec.get("restartPolicy") == "ExitCode" and code >= 128:  # pod.go 352-366: recreate it
            self._delete_pod(pod_name)
            set_condition(
                job["status"],
                self.condition(
                    "Restarting", "PyTorchJobRestarting", f"job {name} is restarting because {rtype} replica(s) failed."
                ),
            )
        elif rspec.get("restartPolicy") in ("ExitCode", "Never"):  # pod.go 367-372
            set_condition(
                job["status"],
                self.condition(
                    "Failed", "PyTorchJobFailed", f'job "{name}" is failing because "{rtype}" replica(s) failed.'
                ),
            )
            job["status"]["completionTime"] = self.stamp()

    def _create_pod(self, job: dict, rtype: str, index: int, rspec: dict) -> None:
        name = job["metadata"]["name"]
        pod_name = f"{name}-{rtype.lower()}-{index}"
        template = rspec["template"]
        spec, container = template["spec"], template["spec"]["containers"][0]
        labels = {
            **(template.get("metadata") or {}).get("labels", {}),
            JOB_NAME_LABEL: name,
            "training.kubeflow.org/replica-type": rtype.lower(),
            "training.kubeflow.org/replica-index": str(index),
            **({JOB_ROLE_LABEL: "master"} if rtype == "Master" else {}),
        }
        owner = client.V1OwnerReference(  # job_controller.go 222-233: blockOwnerDeletion true
            api_version="kubeflow.org/v1", kind="PyTorchJob", name=name, uid=job["metadata"]["uid"],
            controller=True, block_owner_deletion=True,
        )  # fmt: skip
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(
                name=pod_name, namespace=self.namespace, labels=labels, uid=uuid.uuid4().hex, owner_references=[owner]
            ),
            status=client.V1PodStatus(phase="Pending", conditions=[], container_statuses=[]),
        )
        self.core.pods.setdefault(self.namespace, []).append(pod)
        self.core.logs[(self.namespace, pod_name)] = ""
        failed = next((why for prefix, why in self.never_start.items() if pod_name.startswith(prefix)), None)
        if failed is not None:  # the kubelet fails it before any container runs (no container status)
            pod.status.phase, pod.status.reason, pod.status.message = "Failed", *failed
            return None
        problem = self._schedule(pod_name, spec, container)
        if problem is not None:
            return self._pend(pod, *problem)
        env, missing = self._container_env(container)
        if missing:
            return self._pend(pod, "waiting", "CreateContainerConfigError", missing)
        env.update(self._operator_env(job, rtype, index))
        command, args = container.get("command", []), container.get("args", [])
        if self.katib is not None and rtype == "Master":  # Katib's pod webhook, at the pod's creation
            command, args = katib_wrap(command, args, **self.katib)
        argv = [k8s_expand(a, env) for a in [*command, *args]]
        log = self.workdir / f"{pod_name}-{pod.metadata.uid[:8]}.log"
        self.containers[pod_name] = Container(pod_name, argv, base_env(**env), log).start(self.workdir)
        self.started.append(pod_name)
        self.core.add_event(  # the kubelet's event (pkg/kubelet/events/event.go StartedContainer)
            self.namespace, pod_name, "Started", f"Started container {container['name']}", "Normal", pod.metadata.uid
        )
        self.core.logs[(self.namespace, pod_name)] = log
        pod.status.phase = "Running"
        pod.status.container_statuses = [
            client.V1ContainerStatus(
                name=container["name"],
                image=container["image"],
                image_id="",
                ready=True,
                restart_count=0,
                state=client.V1ContainerState(running=client.V1ContainerStateRunning()),
            )
        ]

    def _schedule(self, pod: str, spec: dict, container: dict) -> tuple[str, str, str] | None:
        """(kind, reason, message) that keeps the pod Pending, or None."""
        for volume in spec.get("volumes", []):
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and claim not in self.volumes:
                return (
                    "unschedulable",
                    "Unschedulable",
                    f'0/1 nodes are available: persistentvolumeclaim "{claim}" not found.',
                )
        wanted = int((container.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu", 0))
        if self.gpus is not None and wanted > self.gpus:
            return (
                "unschedulable",
                "Unschedulable",
                (
                    "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are available: "
                    "2 No preemption victims found for incoming pod."
                ),
            )
        if container["image"] in self.unpullable:
            return "waiting", "ImagePullBackOff", f'Back-off pulling image "{container["image"]}"'
        for mount in container.get("volumeMounts", []):
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            assert not claim or self.volumes[claim] == Path(mount["mountPath"]), "mount the PVC where the test has it"
        return None

    def _pend(self, pod, kind: str, reason: str, message: str) -> None:
        if kind == "unschedulable":
            pod.status.conditions = [
                client.V1PodCondition(type="PodScheduled", status="False", reason=reason, message=message)
            ]
            self.core.add_event(self.namespace, pod.metadata.name, "FailedScheduling", message)
        else:
            waiting = client.V1ContainerStateWaiting(reason=reason, message=message)
            pod.status.container_statuses = [
                client.V1ContainerStatus(
                    name="pytorch",
                    image="",
                    image_id="",
                    ready=False,
                    restart_count=0,
                    state=client.V1ContainerState(waiting=waiting),
                )
            ]

    def _container_env(self, container: dict) -> tuple[dict[str, str], str]:
        env, missing = {}, ""
        for var in container.get("env", []):
            ref = (var.get("valueFrom") or {}).get("secretKeyRef")
            if ref is None:
                env[var["name"]] = k8s_expand(var.get("value", ""), env)
            elif ref["name"] not in self.secrets:
                missing = f'secret "{ref["name"]}" not found'
            elif ref["key"] not in self.secrets[ref["name"]]:
                missing = f"couldn't find key {ref['key']} in Secret {self.namespace}/{ref['name']}"
            else:
                env[var["name"]] = self.secrets[ref["name"]][ref["key"]]
        return env, missing

    def _operator_env(self, job: dict, rtype: str, index: int) -> dict[str, str]:
        """pytorch/envvar.go 50-127 (with a Master replica), the master reached on loopback."""
        replicas = job["spec"]["pytorchReplicaSpecs"]
        total = sum(r.get("replicas", 1) for r in replicas.values())
        nproc = job["spec"].get("nprocPerNode")
        rank = index + 1 if rtype == "Worker" else index
        port = str(self.ports[job["metadata"]["name"]])
        env = {
            "PYTHONUNBUFFERED": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": port,
            "WORLD_SIZE": str(total * (int(nproc) if nproc and nproc.isdigit() else 1)),
            "RANK": str(rank),
            "PET_NODE_RANK": str(rank),
            "PET_NNODES": str(total),
        }
        return {**env, **({"PET_NPROC_PER_NODE": nproc} if nproc else {})}

    def _set_terminated(self, pod, code: int) -> None:
        pod.status.phase = "Succeeded" if code == 0 else "Failed"
        status = pod.status.container_statuses[0]
        status.ready = False
        reason = "Completed" if code == 0 else "Error"
        status.state = client.V1ContainerState(
            terminated=client.V1ContainerStateTerminated(exit_code=code, reason=reason)
        )

    def _delete_pod(self, pod_name: str) -> None:
        """Graceful deletion: the pod stays in the API, Terminating (``deletionTimestamp`` set), while its
        container gets SIGTERM and, after the grace period, SIGKILL; it goes from the API when the
        container has ended (:meth:`refresh`). A pod whose container has ended goes at once."""
        pod = self._pod(pod_name)
        if pod is None or pod.metadata.deletion_timestamp is not None:
            return
        container = self.containers.pop(pod_name, None)
        if container is None or container.proc.poll() is not None:
            self.core.remove_pod(self.namespace, pod_name)
            return
        pod.metadata.deletion_timestamp = datetime.datetime.fromtimestamp(self.clock(), datetime.UTC)
        container.signal(signal.SIGTERM)
        self.terminating.append((container, time.monotonic() + self.grace_s))

    def _clean_pods(self, job: str, policy: str) -> None:
        for pod in self.pods(job):
            if policy == "All" or (policy == "Running" and pod.status.phase in ("Running", "Pending")):
                self._delete_pod(pod.metadata.name)

    def on_delete(self, key: tuple, obj: dict) -> None:
        """Garbage collection of what the deleted object owned: its pods are deleted (gracefully). With
        background propagation the object is gone already; with foreground it stays until they are
        (:meth:`_reconcile_job`; kubernetes.io/docs/concepts/architecture/garbage-collection
        #foreground-cascading-deletion)."""
        with self._lock:
            plural, name = key[3], key[4]
            if plural == "pytorchjobs":
                for pod in self.pods(name):
                    self._delete_pod(pod.metadata.name)
            if plural == "inferenceservices" and name in self.servers:
                self.servers.pop(name).stop()

    def dependents(self, key: tuple, obj: dict) -> list:
        """The pods a deleted PyTorchJob still owns (``blockOwnerDeletion``: job_controller.go 222-233); the
        other kinds' dependents are not simulated."""
        if key[3] != "pytorchjobs":
            return []
        return [p for p in self.pods(key[4]) if _owner_uid(p) == obj["metadata"]["uid"]]

    def stop(self) -> None:
        """End every container (test teardown)."""
        with self._lock:
            for container in [*self.containers.values(), *(c for c, _ in self.terminating)]:
                container.kill_all()
            for server in self.servers.values():
                server.stop()

    def stamp(self, offset_s: float = 0.0) -> str:
        """The simulator's clock plus ``offset_s``, as the API server writes a timestamp."""
        return now_rfc3339(self.clock() + offset_s)

    def condition(self, kind: str, reason: str, message: str, status: str = "True") -> dict:
        return condition(kind, reason, message, status, stamp=self.stamp())

    # -- KFP and Argo: the launcher pod, its Workflow, and what sends it SIGTERM -----------------------
    def kfp_launcher(self, pod: str, workflow: str, *, deadline_s: int | None = None, started_ago_s: float = 0.0,
                     task_deadline_s: int | None = None) -> None:  # fmt: skip
        """The run's Workflow (``spec.activeDeadlineSeconds`` ``deadline_s``, ``status.startedAt``) and a
        Running launcher pod it controls (Argo workflowpod.go 172-173), with the pod's own
        ``activeDeadlineSeconds`` from a task timeout (KFP driver.go 703-705). The launcher is the
        test's own process: what stops the pod sends SIGTERM to it (:meth:`_sigterm_launcher`)."""
        started = self.clock() - started_ago_s
        body = {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "metadata": {"name": workflow, "namespace": self.namespace, "uid": f"uid-{workflow}"},
            "spec": {"activeDeadlineSeconds": deadline_s} if deadline_s is not None else {},
            "status": {"phase": "Running", "startedAt": now_rfc3339(started)},
        }
        self.custom.objects[("argoproj.io", "v1alpha1", self.namespace, "workflows", workflow)] = body
        self.task_pod(pod, workflow, started=started, task_deadline_s=task_deadline_s)

    def task_pod(self, pod: str, workflow: str, *, started: float | None = None,
                 task_deadline_s: int | None = None) -> None:  # fmt: skip
        """A Running pod of one of the Workflow's tasks, controlled by it (Argo workflowpod.go 172-173)."""
        owner = client.V1OwnerReference(
            api_version="argoproj.io/v1alpha1", kind="Workflow", name=workflow, uid=f"uid-{workflow}", controller=True
        )
        start = datetime.datetime.fromtimestamp(self.clock() if started is None else started, datetime.UTC)
        self.core.pods.setdefault(self.namespace, []).append(
            client.V1Pod(
                metadata=client.V1ObjectMeta(name=pod, namespace=self.namespace, owner_references=[owner]),
                spec=client.V1PodSpec(containers=[], active_deadline_seconds=task_deadline_s),
                status=client.V1PodStatus(phase="Running", conditions=[], start_time=start),
            )
        )

    def _workflow(self, name: str) -> dict:
        return self.custom.objects[("argoproj.io", "v1alpha1", self.namespace, "workflows", name)]

    def cancel_run(self, workflow: str) -> None:
        """KFP's cancel: ``activeDeadlineSeconds`` patched to 0 (kubeflow/pipelines 2.4.1
        execution_spec.go 315-322, resource_manager.go 797-813); Argo then finds the deadline passed
        and SIGTERMs the running pods (v3.4.17 exec_control.go 55-64, controller.go 507-518)."""
        self._workflow(workflow)["spec"]["activeDeadlineSeconds"] = 0
        self._sigterm_launcher()

    def shutdown_run(self, workflow: str, strategy: str = "Terminate") -> None:
        """``argo terminate`` / ``argo stop``: ``spec.shutdown`` set; Argo SIGTERMs the pods (exec_control.go 38-50)."""
        self._workflow(workflow)["spec"]["shutdown"] = strategy
        self._sigterm_launcher()

    def expire_run(self, workflow: str) -> None:
        """The Workflow's own deadline passes (operator.go 574-584); Argo SIGTERMs the pods (exec_control.go 55-64)."""
        run = self._workflow(workflow)
        run["status"]["startedAt"] = self.stamp(-run["spec"]["activeDeadlineSeconds"] - 1)
        self._sigterm_launcher()

    def evict(self, pod: str, reason: str = "EvictionByEvictionAPI") -> None:
        """A drain or a preemption: Kubernetes adds the DisruptionTarget condition to the pod, then
        deletes it (deletionTimestamp set; the kubelet SIGTERMs its containers). Condition type and
        reasons: k8s.io/api core/v1/types.go; kubernetes.io/docs/concepts/workloads/pods/disruptions."""
        target = self._pod(pod)
        target.status.conditions = [
            *(target.status.conditions or []),
            client.V1PodCondition(
                type="DisruptionTarget", status="True", reason=reason, message="Eviction API: evicting"
            ),
        ]
        target.metadata.deletion_timestamp = datetime.datetime.fromtimestamp(self.clock(), datetime.UTC)
        self._sigterm_launcher()

    def lose_pod(self, workflow: str, pod: str, task: str = "train-model") -> None:
        """Argo lost the task's pod before it recorded the pod's phase (a drain deleted it first, or its node
        went): the node becomes Error "pod deleted" (argo-workflows workflow/controller/operator.go 1175 at
        v3.4.17, 1289 at v4.0.5). KFP compiles retryStrategy without a retryPolicy (kubeflow/pipelines
        backend/src/v2/compiler/argocompiler/container.go 473-504 at 2.4.1), i.e. OnFailure, which does
        not retry an Error (operator.go 1035-1042): the task and the run fail and the exit handler runs."""
        run = self._workflow(workflow)
        node = {"id": pod, "name": f"{workflow}.{task}", "displayName": task, "type": "Pod", "phase": "Error",
                "message": "pod deleted"}  # fmt: skip
        run["status"].setdefault("nodes", {})[pod] = node
        run["status"]["phase"] = "Failed"
        self.core.remove_pod(self.namespace, pod)

    def retry_run(self, workflow: str, pod: str) -> None:
        """KFP's retry of a failed run (``Client.retry_run``, the UI's Retry): the same Workflow, Running
        again, its Error/Failed pod nodes and exit-handler nodes dropped (kubeflow/pipelines 2.4.1
        backend/src/common/util/workflow.go 195-250, GenerateRetryExecution; resource_manager.go 843
        RetryRun); Argo starts a new pod (``pod``) for the task."""
        run = self._workflow(workflow)
        nodes = run["status"].get("nodes") or {}
        run["status"]["nodes"] = {k: n for k, n in nodes.items() if n["phase"] in ("Succeeded", "Skipped")}
        run["status"]["phase"] = "Running"
        self.task_pod(pod, workflow)

    @staticmethod
    def _sigterm_launcher() -> None:
        """Argo's ``kill`` reaches the emissary (PID 1), which forwards it to the process group of the
        launcher (emissary.go 147-155; signal_darwin.go 19-25), where the component's python runs."""
        os.kill(os.getpid(), signal.SIGTERM)

    # -- KServe ------------------------------------------------------------------------------------
    def _reconcile_isvc(self, isvc: dict) -> None:
        name = isvc["metadata"]["name"]
        if name in self.servers:
            return
        model = isvc["spec"]["predictor"]["model"]
        claim, _, sub = model["storageUri"].removeprefix("pvc://").partition("/")
        mounted = self.volumes[claim] / sub
        server = self.servers[name] = FakeVllm(model["args"], mounted).start()
        isvc["status"] = {
            "url": f"http://{name}.{self.namespace}.example.com",
            "address": {"url": server.url},
            "conditions": [{"type": "Ready", "status": "True"}],
            "observedGeneration": isvc["metadata"].get("generation", 1),
        }


# --- Katib ------------------------------------------------------------------------------------------

METRICS_FILE = "/var/log/katib/metrics.log"


def katib_wrap(command: list[str], args: list[str], *, early_stopping: bool, metrics_file: str = METRICS_FILE):
    """(command, args) of a trial's primary container after Katib's pod webhook with the StdOut
    collector (pkg/webhook/v1beta1/pod/utils.go 155-221)."""
    words = [*command, *args]
    head = ["sh", "-c"]
    if words[:2] in (["sh", "-c"], ["bash", "-c"]):
        head, words = words[:2], words[2:]
    words = [*words, f"1>{metrics_file} 2>&1"]
    metrics_dir = os.path.dirname(metrics_file)
    if early_stopping:
        pid_file, condition_file = f"{metrics_dir}/$$$$.pid", f"{metrics_dir}/$$.pid"
        words += [
            "||",
            f"if test -f {pid_file} && [ $(head -n 1 {condition_file}) = early-stopped ]; then echo Training Container "
            "was Early Stopped; else echo Training Container was Failed; exit 1; fi",
        ]
    words += ["&&", f"echo completed > {metrics_dir}/$$$$.pid"]
    return head, [" ".join(words)]


TRIAL_OWNER = ("kubeflow.org/v1beta1", "Trial")


def katib_trial_job(obj: dict, get) -> tuple[str, str] | None:
    """Katib v0.19.0's pod webhook walk to the object a Trial created (``getKatibJob``,
    pkg/webhook/v1beta1/pod/inject_webhook.go 255-300): an object owned by a Trial (apiVersion
    kubeflow.org/v1beta1, kind Trial) is the trial's job; else each owner is read (``get(apiVersion,
    kind, name)``: the webhook's client Get, needing RBAC on that kind) and searched the same way.
    (kind, name) of that job, or None (no injection)."""
    owners = (obj.get("metadata") or {}).get("ownerReferences") or []
    if any((o["apiVersion"], o["kind"]) == TRIAL_OWNER for o in owners):
        return obj["kind"], obj["metadata"]["name"]
    for owner in owners:
        nested = get(owner["apiVersion"], owner["kind"], owner["name"])
        found = katib_trial_job(nested, get) if nested is not None else None
        if found is not None:
            return found
    return None


def katib_mutates(pod: dict, get, trials: dict[str, dict]) -> str:
    """What Katib's webhook does to ``pod`` (inject_webhook.go 110-129 MutationRequired, 131-166 Mutate):
    ``none`` (no trial found: the job's name must be a Trial's), ``labels`` (a trial's pod that is not
    its primary pod: utils.go 41-52 isPrimaryPod), or ``collector`` (the metrics collector injected
    and the primary container wrapped, which must exist: utils.go getPrimaryContainerIndex)."""
    found = katib_trial_job(pod, get)
    if found is None or found[1] not in trials:
        return "none"
    spec = trials[found[1]]["spec"]
    primary = spec.get("primaryPodLabels")
    labels = pod["metadata"].get("labels") or {}
    if primary and any(labels.get(k) != v for k, v in primary.items()):
        return "labels"
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert spec["primaryContainerName"] in names, f"primary container {spec['primaryContainerName']} not in {names}"
    return "collector"


def katib_early_stop(container: Container, metrics_dir: Path) -> None:
    """The collector's early stop (file-metricscollector/main.go 263-296): mark the main process's
    pid file ``early-stopped``, then SIGTERM its single child."""
    import psutil

    main = psutil.Process(container.proc.pid)
    (metrics_dir / f"{main.pid}.pid").write_text("early-stopped")
    children = main.children()
    assert len(children) == 1, f"Katib supports one child process of the main process, found {children}"
    children[0].terminate()


# --- KServe's predictor: a fake vLLM OpenAI server on the real tiny model ---------------------------


class FakeVllm:
    """``/openai/v1/models`` and ``/openai/v1/completions`` of the huggingfaceserver with
    ``--backend=vllm``, as KServe v0.20.0 routes them: names from ``--model_name`` and ``--lora-modules``
    (huggingfaceserver ``__main__.py`` 332-336: ``model_server.register_model(model, lora_module.name)``
    for each, when ``registers_lora_names``; KServe v0.15.0 registers none, kserve#4345); greedy
    completions and token logprobs from transformers (base model, or base + adapter)."""

    def __init__(self, args: list[str], mounted: Path, *, registers_lora_names: bool = True):
        def value(flag: str) -> str | None:
            return next((a.split("=", 1)[1] for a in args if a.startswith(flag + "=")), None)

        local = lambda path: Path(str(path).replace("/mnt/models", str(mounted), 1))  # noqa: E731
        self.base_name = value("--model_name")
        self.base_dir = local(value("--model_dir"))
        modules = args[args.index("--lora-modules") + 1 :] if "--lora-modules" in args else []
        self.loras = {m.split("=", 1)[0]: local(m.split("=", 1)[1]) for m in modules[:1]}
        self.registers_lora_names = registers_lora_names
        self.requests: list[dict] = []
        self._httpd = None

    def registered(self) -> list[str]:
        """Keys of KServe's ModelRepository, all mapped to the one model object (``model_repository.py``
        57-72 ``update``): the base's own name (``ModelServer.start`` -> ``register_model(model)``), then
        each LoRA name."""
        return [self.base_name, *(self.loras if self.registers_lora_names else [])]

    def listing(self) -> list[str]:
        """``GET /openai/v1/models``: ``id = model.name`` for every registry entry (``openai/endpoints.py``
        229-249): the base name once per registered name, never the adapter's."""
        return [self.base_name for _ in self.registered()]

    def adapter_for(self, name: str) -> Path | None:
        if name == self.base_name:  # _maybe_get_adapter: served model names first
            return None
        return self.loras[name]

    def complete(self, name: str, prompt: str, max_tokens: int) -> dict:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        adapter = self.adapter_for(name)
        tokenizer = AutoTokenizer.from_pretrained(self.base_dir)
        model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.eos_token_id,
            )
        new = out.sequences[0, ids.shape[1] :]
        logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, new, strict=False)]
        text = tokenizer.decode(new, skip_special_tokens=True)
        return {"model": name, "choices": [{"text": text, "logprobs": {"token_logprobs": logprobs}}]}

    def start(self) -> FakeVllm:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                if self.path != "/openai/v1/models":
                    return self._send(404, {"error": self.path})
                self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in server.listing()]})

            def do_POST(self):  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(request)
                if request["model"] not in server.registered():  # errors.py model_not_found_handler
                    return self._send(404, {"error": f"Model with name {request['model']} does not exist."})
                self._send(200, server.complete(request["model"], request["prompt"], request["max_tokens"]))

            def log_message(self, *_):
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
