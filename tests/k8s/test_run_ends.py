"""Issue 42.2 and 42.3: no job outlives its run, whichever way the run ends. Each walk plays one run's Argo
Workflow (tests/k8s/kfp_run_sim.py: KFP 2.4.1-2.17.0 and Argo v3.4.17, cited there) through success,
failure, a cancel at every phase of the emissary's 1-s tick, an eviction, a run's Retry, and a second
failure or a cancel after it, with the project's own code at each step: the launcher's SIGTERM handler
(launcher_pod.py), the exit handler (cleanup.py ``cleanup_after_run``) and the janitor (orphans.py
``sweep_orphans``, every ``JANITOR_PERIOD_S``). The job is a TrainJob the launcher created (no controller is
played: it stays unfinished until something deletes it)."""

from __future__ import annotations

import signal

import pytest
from fake_clock import FakeClock
from kfp_run_sim import KfpRun
from kubernetes import client

from llmft.components.lib.contracts.run_jobs import RUN_ID_LABEL, run_label
from llmft.components.lib.jobs.cleanup import cleanup_after_run
from llmft.components.lib.jobs.launcher_pod import KEEP_ANNOTATION, delete_on_sigterm, unmark_kept
from llmft.components.lib.jobs.orphans import JANITOR_PERIOD_S, KEEP_FOR_RETRY_S, sweep_orphans, verdict
from llmft.pipelines.llm_finetune import TRAIN_RETRIES

NS, WF, RUN = "team-a", "llm-finetune-r7x2k", "3f6c1d2e-9a8b-4c7d-8e6f-5a4b3c2d1e0f"
JOB = ("trainer.kubeflow.org", "v1alpha1", NS, "trainjobs", "ft-3f6c1d2e")
TASK = "train-model"


@pytest.fixture
def world(fake_custom_api, fake_core_api, fake_cluster, monkeypatch):
    clock = FakeClock()
    run = KfpRun(fake_custom_api, fake_core_api, NS, WF, RUN, clock)
    printed: list[str] = []
    return {"run": run, "clock": clock, "cluster": fake_cluster, "custom": fake_custom_api, "printed": printed,
            "monkeypatch": monkeypatch}  # fmt: skip


def _create_job(world) -> None:
    """What the launcher's submit leaves: the job, labelled with the run, owned by the run's Workflow."""
    owner = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": WF, "uid": f"uid-{WF}"}
    labels = {RUN_ID_LABEL: run_label(RUN), "app.kubernetes.io/part-of": "kfp-llm-finetune"}
    world["custom"].objects[JOB] = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
                                    "metadata": {"name": JOB[4], "namespace": NS, "labels": labels,
                                                 "ownerReferences": [owner], "uid": "uid-job"}}  # fmt: skip


def _job_alive(world) -> bool:
    return JOB in world["custom"].objects


def _exit_handler(world):
    return lambda pod: cleanup_after_run(RUN, environ={"KFP_POD_NAME": pod}, cluster=world["cluster"])


def _sigterm(world, pod: str) -> int:
    """Argo's SIGTERM to the launcher of ``pod``, handled by the real handler; its exit code."""
    world["monkeypatch"].setenv("KFP_POD_NAME", pod)
    with delete_on_sigterm(world["cluster"], *JOB[:2], JOB[3], JOB[4], print_fn=world["printed"].append):
        with pytest.raises(SystemExit) as stopped:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    return stopped.value.code


def _janitor_until_gone(world) -> float:
    """Run the janitor every JANITOR_PERIOD_S from the run's end until the job is gone; seconds it took."""
    run, clock = world["run"], world["clock"]
    assert run.workflow["status"]["phase"] in ("Succeeded", "Failed", "Error"), "the run has not ended"
    ended = clock()
    while _job_alive(world):
        clock.sleep(JANITOR_PERIOD_S)
        assert clock() - ended <= KEEP_FOR_RETRY_S + 2 * JANITOR_PERIOD_S, "the job outlived its run"
        sweep_orphans(world["cluster"], now=clock(), print_fn=world["printed"].append)
    return clock() - ended


def _evict_drained(world, pod: str) -> None:
    """A drain: the pod gets DisruptionTarget, then SIGTERM; Argo lost it before it saw its end (Error)."""
    target = next(p for p in world["cluster"].core_api.pods[NS] if p.metadata.name == pod)
    target.status.conditions = [client.V1PodCondition(type="DisruptionTarget", status="True",
                                                      reason="EvictionByEvictionAPI")]  # fmt: skip
    assert _sigterm(world, pod) == 143
    world["run"].end_attempt(pod, "Error", "pod deleted")


def test_success_leaves_nothing(world):
    run = world["run"]
    run.attempt(TASK)
    _create_job(world)
    world["custom"].objects[JOB]["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    run.succeed(_exit_handler(world))
    sweep_orphans(world["cluster"], now=world["clock"]())
    assert _job_alive(world) and run.hook_runs == 1  # finished: no GPU; kept for its logs


def test_a_failure_after_the_retries_is_cleaned_up_by_the_exit_handler(world):
    """The launcher dies of a bug (exit 3) on every attempt while its job trains: each retry re-attaches;
    after the last one the exit handler deletes the job."""
    run = world["run"]
    for attempt in range(TRAIN_RETRIES + 1):
        pod = run.attempt(TASK)
        if attempt == 0:
            _create_job(world)
        run.end_attempt(pod, "Failed", "Error (exit code 3)")
        assert run.retries_left(TASK, TRAIN_RETRIES) == (attempt < TRAIN_RETRIES)
    run.fail_task(TASK, _exit_handler(world))
    assert not _job_alive(world) and run.hook_runs == 1


PHASES = [(i + 0.5) / 200 for i in range(200)]
"""Where in the emissary's 1-s tick the SIGTERM lands: uniform over [0, 1) (argoexec signal_*.go 47-59)."""


class _Killed(BaseException):
    """The container died at the emissary's tick, in the middle of an API call."""


def _race(world, tick_in_s: float, call_s: float, patch) -> None:
    """Every API call takes ``call_s``; one that would end after the tick (``tick_in_s`` from now) never
    completes (the container is gone): its effect is not applied."""
    clock, death = world["clock"], world["clock"]() + tick_in_s
    custom, core = world["custom"], world["cluster"].core_api

    def timed(api, method: str) -> None:
        real = getattr(api, method)

        def call(*args, **kwargs):
            clock.sleep(call_s)
            if clock() > death:
                raise _Killed
            return real(*args, **kwargs)

        patch.setattr(api, method, call)

    for method in ("get", "delete", "patch"):
        timed(custom, f"{method}_namespaced_custom_object")
    timed(core, "read_namespaced_pod")


def _cancel_at(world, phase: float, call_s: float, *, hook_runs: bool) -> tuple[bool, float]:
    """Cancel the run while the launcher waits, the emissary's tick ``phase`` s after the signal. Returns
    (the handler's DELETE landed, seconds from the run's end until the job was gone)."""
    run = world["run"]
    pod = run.attempt(TASK)
    _create_job(world)
    world["monkeypatch"].setenv("KFP_POD_NAME", pod)
    with delete_on_sigterm(world["cluster"], *JOB[:2], JOB[3], JOB[4], print_fn=world["printed"].append):
        world["run"].workflow["spec"]["activeDeadlineSeconds"] = 0  # KFP's cancel; then Argo's SIGTERM
        with world["monkeypatch"].context() as patch:
            _race(world, phase, call_s, patch)
            with pytest.raises((SystemExit, _Killed)):
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    handler_won = not _job_alive(world)
    run.cancel(hook_runs=hook_runs, exit_handler=_exit_handler(world))
    return handler_won, _janitor_until_gone(world)


@pytest.mark.parametrize(("call_s", "handler_rate"), [(0.4, 0.20), (0.02, 0.96)], ids=["busy-api", "idle-api"])
def test_a_cancel_frees_the_gpus_at_every_phase_of_the_emissarys_tick(
    call_s, handler_rate, fake_custom_api, fake_core_api, fake_cluster, monkeypatch
):
    """The handler's DELETE (after one GET of the Workflow) lands only when two API calls beat the tick: at
    0.4 s a call, for 20% of the phases; at 20 ms (an idle API server), 96%. It is not what frees the GPUs:
    whatever the phase, the janitor deletes the job within one period of the run's end (the exit handler
    does not run after a cancel, kubeflow/pipelines#6101)."""
    won, took = [], []
    for phase in PHASES:
        fake_custom_api.objects.clear()
        fake_core_api.pods.clear()
        world = {"run": KfpRun(fake_custom_api, fake_core_api, NS, WF, RUN, FakeClock()), "custom": fake_custom_api,
                 "cluster": fake_cluster, "printed": [], "monkeypatch": monkeypatch}  # fmt: skip
        world["clock"] = world["run"].clock
        landed, seconds = _cancel_at(world, phase, call_s, hook_runs=False)
        won.append(landed)
        took.append(seconds)
    assert sum(won) == sum(1 for phase in PHASES if phase >= 2 * call_s) == round(handler_rate * len(PHASES))
    assert max(took) <= JANITOR_PERIOD_S, "a cancelled run's job outlived the run by more than one janitor period"


def test_a_cancel_is_cleaned_up_the_same_whether_or_not_the_exit_handler_runs(world):
    landed, took = _cancel_at(world, 0.0, 0.4, hook_runs=True)
    assert not landed and took == 0.0 and world["run"].hook_runs == 1  # the exit handler deleted it at once


def test_an_eviction_keeps_the_job_for_the_retry_and_the_janitor_frees_it_if_none_comes(world):
    run = world["run"]
    pod = run.attempt(TASK)
    _create_job(world)
    _evict_drained(world, pod)
    assert not run.retries_left(TASK, TRAIN_RETRIES), "Error is not retried (OnFailure)"
    run.fail_task(TASK, _exit_handler(world))
    assert _job_alive(world), "the exit handler keeps an evicted launcher's job for the run's Retry"
    assert KEEP_ANNOTATION in world["custom"].objects[JOB]["metadata"]["annotations"]
    took = _janitor_until_gone(world)
    assert KEEP_FOR_RETRY_S <= took <= KEEP_FOR_RETRY_S + JANITOR_PERIOD_S


def _evicted_then_retried(world) -> str:
    """Eviction, the run fails and is kept; the user Retries the run; the new launcher re-attaches."""
    run = world["run"]
    pod = run.attempt(TASK)
    _create_job(world)
    _evict_drained(world, pod)
    run.fail_task(TASK, _exit_handler(world))
    world["clock"].sleep(300)
    sweep_orphans(world["cluster"], now=world["clock"]())  # within the keep window: kept
    run.retry()
    assert run.workflow["status"]["phase"] == "Running" and run.node(f"{WF}.root.exit-handler-1.onExit")
    pod = run.attempt(TASK)  # the retried task's launcher finds the job and re-attaches (unmarks it)
    unmark_kept(world["cluster"], JOB[:2] + JOB[3:], world["custom"].objects[JOB], NS)
    sweep_orphans(world["cluster"], now=world["clock"]())  # the run is Running: nothing is touched
    assert _job_alive(world) and KEEP_ANNOTATION not in world["custom"].objects[JOB]["metadata"]["annotations"]
    return pod


def test_a_retried_run_that_succeeds_keeps_its_finished_job(world):
    run = world["run"]
    _evicted_then_retried(world)
    world["custom"].objects[JOB]["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    run.succeed(_exit_handler(world))
    assert run.hook_runs == 1, "the exit handler's node was carried over the Retry: it does not run again"
    sweep_orphans(world["cluster"], now=world["clock"]())
    assert _job_alive(world)


def test_a_second_failure_after_a_retry_has_no_exit_handler_and_the_janitor_frees_the_job(world):
    """The re-attached launcher is lost with its node (no SIGTERM, no mark): the run fails again, the exit
    handler does not run (carried over), and only the janitor frees the job (the lost pod keeps it for a
    further Retry for keep_for_retry_s)."""
    run = world["run"]
    pod = _evicted_then_retried(world)
    run.end_attempt(pod, "Error", "pod deleted")
    run.fail_task(TASK, _exit_handler(world))
    assert run.hook_runs == 1 and _job_alive(world), "no exit handler after a Retry: the old code leaked this job"
    took = _janitor_until_gone(world)
    assert took <= KEEP_FOR_RETRY_S + JANITOR_PERIOD_S


def test_a_launcher_crash_after_a_retry_is_freed_within_one_period(world):
    """After the Retry the launcher fails on every attempt (exit 3; a bug): the run fails without an exit
    handler; nothing keeps the job, so the janitor deletes it at its next pass."""
    run = world["run"]
    pod = _evicted_then_retried(world)
    run.end_attempt(pod, "Failed", "Error (exit code 3)")
    for _ in range(TRAIN_RETRIES):
        run.end_attempt(run.attempt(TASK), "Failed", "Error (exit code 3)")
    run.fail_task(TASK, _exit_handler(world))
    assert run.hook_runs == 1 and _job_alive(world)
    assert _janitor_until_gone(world) <= JANITOR_PERIOD_S


def test_a_cancel_after_a_retry_is_freed_within_one_period(world):
    run = world["run"]
    pod = _evicted_then_retried(world)
    world["monkeypatch"].setenv("KFP_POD_NAME", pod)
    with delete_on_sigterm(world["cluster"], *JOB[:2], JOB[3], JOB[4], print_fn=world["printed"].append):
        run.workflow["spec"]["activeDeadlineSeconds"] = 0
        with world["monkeypatch"].context() as patch:
            _race(world, 0.0, 0.4, patch)  # the handler loses the race
            with pytest.raises((SystemExit, _Killed)):
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    run.cancel(hook_runs=True, exit_handler=_exit_handler(world))
    assert run.hook_runs == 1 and _job_alive(world)
    assert _janitor_until_gone(world) <= JANITOR_PERIOD_S


def test_a_kubelet_eviction_on_the_last_attempt_keeps_the_job_without_the_launchers_mark(world):
    """Node pressure: the kubelet stops the pod without deleting it (Failed, reason Evicted), Argo retries it;
    on the last attempt the run fails. The launcher's mark did not land (its DisruptionTarget came late, its
    PATCH lost the race): the exit handler reads the evicted pod itself and keeps the job for the Retry."""
    run = world["run"]
    _create_job(world)
    for _ in range(TRAIN_RETRIES + 1):
        run.end_attempt(run.attempt(TASK), "Failed", "Evicted", evicted_by_kubelet=True)
    run.fail_task(TASK, _exit_handler(world))
    assert _job_alive(world) and KEEP_ANNOTATION not in (
        world["custom"].objects[JOB]["metadata"].get("annotations") or {}
    )
    took = _janitor_until_gone(world)
    assert KEEP_FOR_RETRY_S <= took <= KEEP_FOR_RETRY_S + JANITOR_PERIOD_S


@pytest.mark.parametrize(
    ("workflow", "annotations", "expected"),
    [
        ({"metadata": {"name": "w"}, "status": {"phase": "Running"}}, {}, "keep"),
        ({"metadata": {"name": "w"}, "status": {"phase": "Failed"}}, {}, "delete"),
        ({"metadata": {"name": "w"}, "status": {"phase": "Succeeded"}}, {}, "delete"),
        ({"metadata": {"name": "w"}, "status": {"phase": "Failed"}}, {KEEP_ANNOTATION: "evicted"}, "keep"),
        (None, {}, "keep"),
    ],
    ids=["running", "failed", "succeeded-unfinished", "kept-for-retry", "unreadable"],
)
def test_the_janitors_rule(workflow, annotations, expected):
    clock = FakeClock()
    if workflow is not None:
        workflow["status"]["finishedAt"] = clock.rfc3339()
    obj = {"metadata": {"name": "j", "annotations": annotations}}
    assert verdict(obj, workflow, now=clock(), keep_for_retry_s=KEEP_FOR_RETRY_S)[0] == expected
    if annotations:  # past the keep window it goes
        assert verdict(obj, workflow, now=clock() + KEEP_FOR_RETRY_S, keep_for_retry_s=KEEP_FOR_RETRY_S)[0] == "delete"


def test_llmft_pipeline_janitor_deletes_an_ended_runs_job_and_says_so(world, monkeypatch, capsys):
    from llmft import cli
    from llmft.commands import janitor

    run = world["run"]
    run.attempt(TASK)
    _create_job(world)
    run.cancel(hook_runs=False, exit_handler=_exit_handler(world))
    monkeypatch.setattr(janitor, "Cluster", lambda namespace: world["cluster"])
    assert cli.main(["pipeline", "janitor", "--dry-run"]) == 0 and _job_alive(world)
    assert cli.main(["pipeline", "janitor"]) == 0 and not _job_alive(world)
    out = capsys.readouterr().out
    assert f"would delete unfinished TrainJob {NS}/{JOB[4]}: its run's Workflow {WF} ended Failed" in out
    assert "janitor: 1 deleted, 0 kept unfinished" in out
    assert cli.main(["pipeline", "janitor", "--keep-for-retry-s", "-1"]) == 1
    assert "--keep-for-retry-s -1: must be >= 0" in capsys.readouterr().err
