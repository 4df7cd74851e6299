"""A failed job is recreated under the same name only once it and its pods are gone (issue 29.5):
foreground deletion, then a bounded wait (llmft/components/lib/jobs/pytorchjob_launch.py ``wait_until_gone``). On the
simulated cluster of cluster_sim.py, which keeps a deleted pod in the API while it terminates and
models background vs foreground propagation (Kubernetes garbage collection:
kubernetes.io/docs/concepts/architecture/garbage-collection). No real cluster runs here."""

from __future__ import annotations

import pytest
from cluster_sim import condition, set_condition
from sim_plans import SIM_NAMESPACE, sim_plan

from llmft.components.lib.cluster import wait_until_gone
from llmft.components.lib.jobs.backends import run_on_cluster
from llmft.components.lib.jobs.pytorchjob_spec import (
    GROUP,
    PLURAL,
    VERSION,
    build_job_spec,
    build_pytorchjob,
    pytorchjob_to_dict,
)
from llmft.trainer.errors import TransientError


@pytest.mark.slow
def test_a_failed_job_is_recreated_only_after_its_pods_are_gone(sim, fake_cluster, fake_custom_api, sim_volume):
    """An earlier attempt's job Failed (not permanently) while its master still ran (cleanPodPolicy
    None keeps it). The retry deletes it; with background propagation the job vanished at once and
    the new job met the old master still terminating (committing its SIGTERM checkpoint): the
    operator could not create ``<job>-master-0`` (AlreadyExists). Foreground: no collision."""
    plan = sim_plan(sim_volume, run_id="run-recreate", finetune_max_steps=6)
    overrides = plan.trainer.launch(f"{sim_volume}/tokenized/demo")
    first = pytorchjob_to_dict(build_pytorchjob(build_job_spec(plan.job, overrides)))
    first["spec"]["runPolicy"]["cleanPodPolicy"] = "None"
    fake_cluster.create_custom_object(GROUP, VERSION, PLURAL, first)
    master = f"{plan.job.name}-master-0"
    sim.wait_for_log(master, "step=1 ")
    old = fake_custom_api.objects[(GROUP, VERSION, SIM_NAMESPACE, PLURAL, plan.job.name)]
    set_condition(old["status"], condition("Failed", "PyTorchJobFailed", "a lost node, past the backoff limit"))
    printed: list[str] = []
    result = run_on_cluster(plan.job, overrides, cluster=fake_cluster, poll_s=0.2, owner={}, print_fn=printed.append)
    assert result["succeeded"] and not result["reattached"]
    assert any("recreating it" in line for line in printed)
    assert fake_custom_api.propagations == ["Foreground"]
    assert sim.collisions == [], "the new job met the old job's terminating pod"
    assert sim.started == [master, master]


def test_the_wait_for_a_deleted_job_is_bounded_and_names_what_is_left():
    with pytest.raises(TransientError) as error:
        wait_until_gone("PyTorchJob team-a/x", lambda: False, lambda: ["x-master-0"], timeout_s=0, poll_s=0)
    message = str(error.value)
    assert "pod x-master-0" in message and "--grace-period=0 --force" in message and "\n" not in message


@pytest.mark.slow
def test_a_quick_retry_after_a_cancel_waits_for_the_cancelled_pods(
    sim, fake_cluster, fake_custom_api, sim_volume, monkeypatch
):
    """Issue 42 (Low): the run is cancelled while its job trains (the launcher's SIGTERM deletes the job, now
    with foreground propagation), then Retried at once. The retry's launcher finds the job still being deleted
    (its master committing its SIGTERM checkpoint) and waits until it and its pods are gone before creating it
    again: no pod-name collision, no second trainer on the run directory; the new job resumes and succeeds."""
    import signal
    import threading

    launcher, workflow = "llm-finetune-x7k2p-system-container-impl-1", "llm-finetune-x7k2p"
    monkeypatch.setenv("KFP_POD_NAME", launcher)
    sim.kfp_launcher(launcher, workflow, deadline_s=3600)
    plan = sim_plan(sim_volume, run_id="run-quick-retry", finetune_max_steps=6)
    launch = plan.trainer.launch(f"{sim_volume}/tokenized/demo")
    master = f"{plan.job.name}-master-0"
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        threading.Thread(
            target=lambda: (sim.wait_for_log(master, "step=1 "), sim.cancel_run(workflow)), daemon=True
        ).start()
        with pytest.raises(SystemExit) as stopped:
            run_on_cluster(plan.job, launch, cluster=fake_cluster, poll_s=0.2, owner={}, print_fn=lambda _: None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    key = (GROUP, VERSION, SIM_NAMESPACE, PLURAL, plan.job.name)
    assert fake_custom_api.objects[key]["metadata"].get("deletionTimestamp"), "foreground: the job waits for its pods"
    del sim._workflow(workflow)["spec"]["activeDeadlineSeconds"]  # the Retry unsets a cancel's deadline of 0
    printed: list[str] = []
    result = run_on_cluster(plan.job, launch, cluster=fake_cluster, poll_s=0.2, owner={}, print_fn=printed.append)
    assert result["succeeded"] and not result["reattached"]
    assert any("being deleted: waiting until it is gone" in line for line in printed), printed[:5]
    assert sim.collisions == [] and [pod for pod, code in sim.history if pod == master and code == 1] == []
