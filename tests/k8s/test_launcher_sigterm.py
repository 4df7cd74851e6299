"""Eviction is not cancellation (issue 29.1): a launcher's SIGTERM deletes its job only when the run
was cancelled or timed out (llmft/components/lib/jobs/cleanup.py ``sigterm_cause``); an evicted launcher leaves
the job running and the retried task re-attaches to it. On the simulated cluster of cluster_sim.py
(pods are real local processes; the launcher is this test's process; no real cluster runs here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from cluster_sim import ClusterSim
from conftest import SIM_NAMESPACE, sim_plan
from fake_clock import FakeClock
from k8s_fakes import api_error

from llmft.components.lib.jobs import trainjob_spec
from llmft.components.lib.jobs.backends import run_on_cluster
from llmft.components.lib.jobs.launcher_pod import KEEP_ANNOTATION, delete_on_sigterm, sigterm_cause
from llmft.components.lib.jobs.pytorchjob_spec import GROUP, PLURAL, VERSION

LAUNCHER = "llm-finetune-x7k2p-system-container-impl-1"
WORKFLOW = "llm-finetune-x7k2p"


@pytest.fixture
def launcher_sim(tmp_path, fake_custom_api, fake_core_api, fake_cluster, monkeypatch):
    """A simulator with no volume (nothing runs), for the decision alone."""
    monkeypatch.setenv("KFP_POD_NAME", LAUNCHER)
    return ClusterSim(fake_custom_api, fake_core_api, SIM_NAMESPACE, tmp_path / "pods")


@pytest.mark.parametrize(
    ("setup", "expected", "shown"),
    [
        (lambda s: s.evict(LAUNCHER), "evicted", "DisruptionTarget EvictionByEvictionAPI"),
        (lambda s: s.evict(LAUNCHER, "PreemptionByScheduler"), "evicted", "PreemptionByScheduler"),
        (lambda s: s.cancel_run(WORKFLOW), "cancelled", "activeDeadlineSeconds 0"),
        (lambda s: s.shutdown_run(WORKFLOW, "Stop"), "cancelled", "spec.shutdown Stop"),
        (lambda s: s.expire_run(WORKFLOW), "timed out", "passed its activeDeadlineSeconds 3600"),
        (lambda s: s._sigterm_launcher(), "other", "neither cancelled nor past its deadline"),
    ],
    ids=["drained", "preempted", "kfp-cancel", "argo-stop", "workflow-deadline", "deleted-by-hand"],
)
def test_the_cause_of_a_launchers_sigterm_is_read_from_its_pod_and_workflow(
    setup, expected, shown, launcher_sim, fake_cluster
):
    launcher_sim.kfp_launcher(LAUNCHER, WORKFLOW, deadline_s=3600)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # the simulator's SIGTERM to this process
    try:
        setup(launcher_sim)
    finally:
        signal.signal(signal.SIGTERM, previous)
    kind, why = sigterm_cause(fake_cluster)
    assert kind == expected and shown in why, why


def test_a_task_timeout_is_read_from_the_pods_own_deadline(launcher_sim, fake_cluster):
    """kfp-kubernetes set_timeout -> the pod's activeDeadlineSeconds (KFP 2.4.1 driver.go 703-705)."""
    launcher_sim.kfp_launcher(LAUNCHER, WORKFLOW, task_deadline_s=60, started_ago_s=61)
    kind, why = sigterm_cause(fake_cluster)
    assert kind == "timed out" and "the task's timeout" in why


@pytest.mark.parametrize("unreadable", [True, False], ids=["workflow-unreadable", "no-disruption-shown-yet"])
def test_a_sigterm_the_workflow_does_not_explain_keeps_and_marks_the_job(
    unreadable, launcher_sim, fake_cluster, fake_custom_api, fake_core_api
):
    """Issue 42 (Low): a kubelet eviction (node pressure, graceful node shutdown) writes the pod's
    DisruptionTarget asynchronously, so the handler may read no disruption ("other"); a Workflow that did not
    answer gives "unknown" (it used to delete the job then, an eviction's included). Both keep the job, marked
    for the run's retry: a cancel the handler could not see is the janitor's (tests/k8s/test_run_ends.py)."""
    launcher_sim.kfp_launcher(LAUNCHER, WORKFLOW)
    job = _trainjob(fake_custom_api, "ft-unexplained")
    if unreadable:

        def forbidden(*args, **kwargs):
            raise api_error(403, 'workflows.argoproj.io "llm-finetune-x7k2p" is forbidden')

        real_get = fake_custom_api.get_namespaced_custom_object
        fake_custom_api.get_namespaced_custom_object = lambda *a, **k: (
            forbidden() if a[3] == "workflows" else real_get(*a, **k)
        )
    printed: list[str] = []
    with delete_on_sigterm(fake_cluster, *job[:2], job[3], job[4], print_fn=printed.append):
        with pytest.raises(SystemExit) as stopped:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    kind = "unknown" if unreadable else "other"
    assert stopped.value.code == 143 and any(f"SIGTERM ({kind}: " in line and "keeping" in line for line in printed)
    assert job in fake_custom_api.objects
    mark = fake_custom_api.objects[job]["metadata"]["annotations"][KEEP_ANNOTATION]
    assert mark.startswith(f"launcher {kind}: ") and ("HTTP 403" in mark) is unreadable


API_CALL_S = 0.4
"""Seconds each API call takes in the cancel-window test: a loaded API server (an idle one answers in
~10-50 ms); the fake clock advances by it on every call, so the test measures calls, not this machine."""
EMISSARY_POLL_S = 1.0
"""Argo's emissary polls its child every second once the KFP launcher (no signal handler) is gone, then
exits and the container's processes die (argoexec v3.4.17 workflow/executor/os-specific/signal_darwin.go
46-59, linked as signal_linux.go; cmd/argoexec/commands/emissary.go 147-155)."""


def _timed_api(clock: FakeClock, fake_custom_api, fake_core_api) -> list[str]:
    """Make every API call take API_CALL_S on ``clock``; returns the list the calls are logged to."""
    calls: list[str] = []

    def timed(api, method: str, what):
        real = getattr(api, method)

        def call(*args, **kwargs):
            clock.sleep(API_CALL_S)
            calls.append(what(*args, **kwargs))
            return real(*args, **kwargs)

        setattr(api, method, call)

    timed(fake_core_api, "read_namespaced_pod", lambda name, namespace, **_: f"GET pod {name}")
    for method, verb in (("get", "GET"), ("delete", "DELETE"), ("patch", "PATCH")):
        timed(fake_custom_api, f"{method}_namespaced_custom_object",
              lambda *a, verb=verb, **k: f"{verb} {k.get('plural', a[3] if len(a) > 3 else '')}")  # fmt: skip
    return calls


def _trainjob(fake_custom_api, name: str) -> tuple:
    key = (trainjob_spec.GROUP, trainjob_spec.VERSION, SIM_NAMESPACE, trainjob_spec.PLURAL, name)
    fake_custom_api.objects[key] = {"apiVersion": f"{key[0]}/{key[1]}", "kind": "TrainJob",
                                    "metadata": {"name": name, "namespace": SIM_NAMESPACE}}  # fmt: skip
    return key


def test_a_cancel_deletes_the_job_after_one_get_inside_the_emissarys_poll(
    launcher_sim, fake_cluster, fake_custom_api, fake_core_api
):
    """Issue 34.2, the handler's calls. The launcher pod is read once before training (its Workflow owner,
    its task deadline); on SIGTERM one GET of the Workflow precedes the DELETE: at API_CALL_S a call the
    DELETE is answered 2 x 0.4 = 0.8 s after the signal (the old order, GET pod, GET Workflow, DELETE, took
    1.2 s). The emissary's tick comes uniformly 0-1 s after the signal, so that DELETE lands for 20% of the
    phases (issue 42.3): tests/k8s/test_run_ends.py walks every phase and shows the run's janitor, not this
    handler, is what frees the GPUs whatever the phase."""
    launcher_sim.kfp_launcher(LAUNCHER, WORKFLOW, deadline_s=3600)
    job = _trainjob(fake_custom_api, "ft-cancel")  # a TrainJob: the simulator plays no controller for it
    clock, printed = FakeClock(), []
    calls = _timed_api(clock, fake_custom_api, fake_core_api)
    with delete_on_sigterm(fake_cluster, *job[:2], job[3], job[4], print_fn=printed.append):
        assert calls == [f"GET pod {LAUNCHER}"]  # before training starts
        calls.clear()
        signalled = clock()
        launcher_sim._workflow(WORKFLOW)["spec"]["activeDeadlineSeconds"] = 0  # KFP's cancel (then Argo signals)
        with pytest.raises(SystemExit) as stopped:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert stopped.value.code == 143 and any("SIGTERM (cancelled: " in line for line in printed), printed
    assert calls == ["GET workflows", "DELETE trainjobs"]
    assert job not in fake_custom_api.objects
    assert clock() - signalled == pytest.approx(2 * API_CALL_S)  # a fraction 1 - 0.8 of the tick's phases


def _job_key(plan) -> tuple:
    return (GROUP, VERSION, SIM_NAMESPACE, PLURAL, plan.job.name)


def _launch(plan, fake_cluster, printed: list, stop) -> int:
    """Run the launcher until ``stop`` (in a thread, once the master trains) sends it SIGTERM; its exit code."""

    def unhandled(signum, frame):
        raise AssertionError("SIGTERM reached the test: the launcher did not handle it")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        threading.Thread(target=stop, daemon=True).start()
        with pytest.raises(SystemExit) as stopped:
            run_on_cluster(plan.job, plan.trainer.launch(f"{plan.layout.root}/tokenized/demo"),
                           cluster=fake_cluster, poll_s=0.2, owner={}, print_fn=printed.append)  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, previous)
    return stopped.value.code


@pytest.mark.slow
def test_an_evicted_launcher_keeps_the_job_and_the_retry_reattaches(
    sim, fake_cluster, fake_custom_api, sim_volume, monkeypatch
):
    """A drain of the launcher's node: the job trains on (no progress lost, no GPU queue again); the
    launcher exits 143 and the task's retry re-attaches to the same job, which finishes."""
    monkeypatch.setenv("KFP_POD_NAME", LAUNCHER)
    sim.kfp_launcher(LAUNCHER, WORKFLOW)
    plan = sim_plan(sim_volume, run_id="run-evicted", finetune_max_steps=6)
    master = f"{plan.job.name}-master-0"
    printed: list[str] = []
    code = _launch(plan, fake_cluster, printed, lambda: (sim.wait_for_log(master, "step=1 "), sim.evict(LAUNCHER)))
    assert code == 143
    assert any("SIGTERM (evicted: " in line and "keeping pytorchjobs" in line for line in printed), printed[-5:]
    assert _job_key(plan) in fake_custom_api.objects and master in sim.running()
    monkeypatch.setenv("KFP_POD_NAME", LAUNCHER.replace("-1", "-2"))  # the retry's pod
    result = run_on_cluster(plan.job, plan.trainer.launch(f"{sim_volume}/tokenized/demo"),
                            cluster=fake_cluster, poll_s=0.2, owner={}, print_fn=printed.append)  # fmt: skip
    assert result["succeeded"] and result["reattached"]
    assert [c[0] for c in fake_custom_api.calls if c[0] in ("create", "delete") and c[4] == PLURAL] == ["create"]
    assert [pod for pod, _ in sim.history] == [master], "one container ran the whole job: nothing was restarted"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cancel", "terminate", "deadline"])
def test_a_cancelled_or_timed_out_run_deletes_the_job(how, sim, fake_cluster, fake_custom_api, sim_volume, monkeypatch):
    monkeypatch.setenv("KFP_POD_NAME", LAUNCHER)
    sim.kfp_launcher(LAUNCHER, WORKFLOW, deadline_s=3600)
    plan = sim_plan(sim_volume, run_id=f"run-{how}", finetune_max_steps=5000)
    stop = {"cancel": sim.cancel_run, "terminate": sim.shutdown_run, "deadline": sim.expire_run}[how]

    def when_created() -> None:
        while _job_key(plan) not in fake_custom_api.objects:
            time.sleep(0.05)
        stop(WORKFLOW)

    printed: list[str] = []
    assert _launch(plan, fake_cluster, printed, when_created) == 143
    expected = "timed out" if how == "deadline" else "cancelled"
    assert any(f"SIGTERM ({expected}: " in line and "deleting pytorchjobs" in line for line in printed), printed
    assert fake_custom_api.propagations[-1] == "Foreground"  # the job stays until its pods have stopped
    deadline = time.monotonic() + 120
    while _job_key(plan) in fake_custom_api.objects and time.monotonic() < deadline:
        sim.reconcile()
        time.sleep(0.2)
    assert _job_key(plan) not in fake_custom_api.objects and not sim.pods(plan.job.name)


@pytest.mark.slow
def test_argos_sigterm_reaches_the_components_python_through_sh(tmp_path):
    """Argo v3.4.17 signals the emissary, which forwards to the process group of the command it
    started with Setpgid (cmd/argoexec/commands/emissary.go 147-155, os-specific/command_unix.go 33,
    signal_darwin.go 19-25); KFP's launcher (launcher_v2.go 410-415 at 2.4.1) starts the component's
    ``sh -ec`` in that group without handling signals. So python3 under ``sh -ec`` gets the SIGTERM
    itself: no ``exec`` is needed in the component's command (kfp's lightweight-component shape)."""
    from llmft.components.train import train_model

    command = train_model.component_spec.implementation.container.command
    assert command[:2] == ["sh", "-ec"] and "python3 -m kfp.dsl.executor_main" in command[2]
    marker = tmp_path / "handled"
    program = (
        "import signal, sys, time, pathlib\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).write_text('143'), sys.exit(143)))\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    script = f'program_path=$(mktemp -d)\n"{sys.executable}" -c "$0"\n'  # the component's shape: python last
    launcher = (  # KFP's launcher: runs the command in its own process group, handles no signal
        f"import subprocess, sys; sys.exit(subprocess.call(['sh', '-ec', {script!r}, {program!r}]))"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGTERM)  # the emissary's forwarding: kill(-pgid, SIGTERM)
        proc.wait(timeout=30)  # the launcher dies at once (no handler); python3 handles it in parallel
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert marker.read_text() == "143", "python3 under sh -ec did not get the SIGTERM"
