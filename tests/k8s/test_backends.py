"""One registry of training backends (llmft/components/lib/jobs/backends.py, issue 38.2): a backend is one module
plus one ``register`` call. A toy backend registered here, and nowhere else, is reached by the train step's
dispatch, the sweep's trial building (and Katib's trial-kind rules), render-job and the run's cleanup."""

from __future__ import annotations

import pytest
from cluster_sim import now_rfc3339, parse_rfc3339
from sim_plans import sim_plan
from toy_backend import TOY, TOY_BACKEND, TOY_TRIAL, toy_body

from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.contracts.run_jobs import (
    JOB_WAIT_GRACE_S,
    RUN_ID_LABEL,
    JobFailedPermanently,
    JobTimedOut,
    run_label,
)
from llmft.components.lib.jobs import backends
from llmft.components.lib.jobs.backends import (
    NO_TRIALS,
    OWN_TRIALS,
    Backend,
    backend_for,
    register,
    render_names,
    run_on_cluster,
    run_resources,
)
from llmft.components.lib.jobs.cleanup import cleanup_run
from llmft.components.lib.jobs.pytorchjob_spec import build_job_spec
from llmft.katib.trial_kinds import TRIAL_KINDS, trial_kind
from llmft.trainer.errors import ConfigError


@pytest.fixture
def toy():
    """The toy backend (tests/k8s/toy_backend.py, one module), registered by its one entry."""
    register(TOY_BACKEND)
    try:
        yield TOY_BACKEND
    finally:
        backends.unregister("toyjob")
    assert (TOY.api_version, TOY.kind) not in TRIAL_KINDS, "unregister takes its trial kind back"


def _toy_controller(fake_custom_api, *, runs_for: int, ends: str = "Done", reason: str = "Trained"):
    """A ToyJob controller on the fake API server: a job is Running (with its startTime) from its first read and
    ends (``Done``, or ``Failed`` with ``reason``) on its ``runs_for``-th; conditions stay once set."""

    def on_get(job: dict, count: int) -> None:
        if job["kind"] != TOY.kind or _ended(job):
            return
        status = job.setdefault("status", {})
        status.setdefault("startTime", now_rfc3339())
        kind, why = (ends, reason) if count >= runs_for else ("Running", "Started")
        status["conditions"] = [{"type": kind, "status": "True", "reason": why, "message": f"toy {why}"}]

    fake_custom_api.on_get = on_get


def _ended(job: dict) -> bool:
    return any(c["type"] in ("Done", "Failed") for c in (job.get("status") or {}).get("conditions") or [])


def _toy_plan(sim_volume, run_id: str):
    plan = sim_plan(sim_volume, training_backend="toyjob", run_id=run_id)
    return plan, plan.trainer.launch(f"{sim_volume}/tokenized/demo", ["lora.r=8"])


def _earlier_toyjob(fake_cluster, plan, launch, condition: dict) -> None:
    body = toy_body(plan.job, build_job_spec(plan.job, launch))
    fake_cluster.create_custom_object(*TOY[:3], {**body, "status": {"startTime": now_rfc3339(), "conditions": [
        {"status": "True", **condition}]}})  # fmt: skip


def _verbs(fake_custom_api) -> list[str]:
    return [call[0] for call in fake_custom_api.calls if call[0] in ("create", "delete")]


def test_the_registry_holds_the_three_backends_and_the_pipeline_values():
    assert list(backends.BACKENDS) == ["pytorchjob", "trainjob", "local"]
    assert render_names() == {"pytorchjob": "pytorchjob", "trainjob": "trainjob"}
    assert [r.plural for r in run_resources()] == ["pytorchjobs", "experiments", "trainjobs"]  # API order
    with pytest.raises(ConfigError, match="training_backend='rayjob' is not a training backend"):
        backend_for("rayjob")


def test_the_older_name_kubeflow_still_means_a_pytorchjob(sim_volume):
    """Issue 48.6: ``training_backend=kubeflow`` was renamed ``pytorchjob`` (a TrainJob is Kubeflow too); a run,
    a recurring run or a notebook that still says kubeflow gets the PyTorchJob, its plan under the new name."""
    assert backend_for("kubeflow") is backend_for("pytorchjob")
    plan = sim_plan(sim_volume, training_backend="kubeflow")
    assert plan.job.backend == "pytorchjob"
    from llmft.commands.render_job import render_job

    arguments = {"training_backend": "kubeflow", "mlflow_tracking_uri": "http://mlflow.example:5000"}
    body = render_job(arguments, "pytorchjob", run_id="RUN-ID", namespace=None, data="/data/tok")
    assert body["kind"] == "PyTorchJob"  # not "training_backend=kubeflow contradicts --backend pytorchjob"


def test_the_train_step_dispatches_to_a_registered_backend(toy, sim_volume, fake_cluster, fake_custom_api,
                                                           monkeypatch):  # fmt: skip
    plan, launch = _toy_plan(sim_volume, "run-toy")
    monkeypatch.setattr(cluster_module, "Cluster", lambda *a, **k: fake_cluster)  # no kube config here
    _toy_controller(fake_custom_api, runs_for=1)

    result = backend_for(plan.job.backend).run_train_step(plan, launch)  # llmft/components/train.py's line

    assert (result["name"], result["outcome"]) == (plan.job.name, "created")
    [created] = fake_custom_api.created("toyjobs")
    assert created["spec"]["overrides"] == {"data": f"{sim_volume}/tokenized/demo", "lora.r": "8"}
    assert created["spec"]["command"] == ["llmft", "train"]


def test_a_toy_backend_submits_and_waits_for_its_job_through_the_shared_lifecycle(toy, sim_volume, fake_cluster,
                                                                                 fake_custom_api):  # fmt: skip
    """Issue 48.2's "done when": one module (tests/k8s/toy_backend.py: an adapter of five members and an attach
    of one call) plus one registry entry, its Katib trial policy explicit, submits its job and waits for it:
    polling until Done, the earlier attempt's job settled first, the run's SIGTERM guard around it."""
    assert toy.katib_trials == OWN_TRIALS and toy.trials_backend() is toy
    plan, launch = _toy_plan(sim_volume, "run-toy-wait")
    _toy_controller(fake_custom_api, runs_for=4)
    printed: list[str] = []

    result = run_on_cluster(plan.job, launch, poll_s=0.01, cluster=fake_cluster, print_fn=printed.append)

    assert result["outcome"] == "created" and result["final"]["status"]["conditions"][0]["type"] == "Done"
    assert fake_custom_api.gets[(*TOY[:2], "team-a", TOY.plural, plan.job.name)] == 4  # polled until Done
    assert _verbs(fake_custom_api) == ["create"]


def test_a_toy_backends_retry_reattaches_reuses_or_recreates_as_the_lifecycle_decides(toy, sim_volume, fake_cluster,
                                                                                     fake_custom_api):  # fmt: skip
    """A retried task: a running job is re-attached to (never deleted), a Done one is not run again, a failed one
    (not permanently) is deleted with foreground propagation and recreated."""
    cases = (
        ({"type": "Running", "reason": "Started"}, "attached", ["create"], "re-attaching to it"),
        ({"type": "Done", "reason": "Trained"}, "reused", ["create"], "already Done (an earlier attempt"),
        ({"type": "Failed", "reason": "NodeLost"}, "created", ["create", "delete", "create"],
         "failed in an earlier attempt (not permanently: NodeLost): recreating it"),
    )  # fmt: skip
    for index, (condition, outcome, verbs, said) in enumerate(cases):
        plan, launch = _toy_plan(sim_volume, f"run-toy-retry-{index}")
        fake_custom_api.calls.clear()
        _earlier_toyjob(fake_cluster, plan, launch, condition)
        _toy_controller(fake_custom_api, runs_for=2)
        printed: list[str] = []

        result = run_on_cluster(plan.job, launch, poll_s=0.01, cluster=fake_cluster, print_fn=printed.append)

        assert result["outcome"] == outcome and _verbs(fake_custom_api) == verbs, (condition, printed)
        assert any(said in line for line in printed), printed
    assert fake_custom_api.propagations == ["Foreground"]


def test_a_toy_backends_permanent_failure_and_deadline_are_the_lifecycles(toy, sim_volume, fake_cluster,
                                                                        fake_custom_api):  # fmt: skip
    """Its adapter says what is permanent (BadInput): the wait fails at once, and a retry fails the same way
    without recreating the job; its deadline clock (startTime + activeDeadlineSeconds) bounds the shared wait."""
    plan, launch = _toy_plan(sim_volume, "run-toy-bad")
    _toy_controller(fake_custom_api, runs_for=2, ends="Failed", reason="BadInput")
    for when in ("", " in an earlier attempt of this task"):
        with pytest.raises(JobFailedPermanently, match=f"ToyJob team-a/{plan.job.name} failed permanently{when}:"):
            run_on_cluster(plan.job, launch, poll_s=0.01, cluster=fake_cluster, print_fn=lambda _: None)
    assert _verbs(fake_custom_api) == ["create"]

    plan, launch = _toy_plan(sim_volume, "run-toy-late")
    _earlier_toyjob(fake_cluster, plan, launch, {"type": "Running", "reason": "Started"})
    key = (*TOY[:2], "team-a", TOY.plural, plan.job.name)
    fake_custom_api.objects[key]["status"]["startTime"] = now_rfc3339(
        parse_rfc3339(now_rfc3339()) - plan.job.timeout_s - JOB_WAIT_GRACE_S - 60
    )  # its own deadline, plus the grace, passed a minute ago
    fake_custom_api.on_get = None
    with pytest.raises(JobTimedOut, match=f"ToyJob team-a/{plan.job.name} did not finish by its deadline"):
        run_on_cluster(plan.job, launch, poll_s=0.01, cluster=fake_cluster, print_fn=lambda _: None)


def test_render_job_and_the_sweep_build_the_registered_backends_job(toy, sim_volume):
    from llmft.commands.render_job import render_job
    from llmft.components.lib.jobs.katib_sweep import build_sweep_experiment
    from llmft.katib.experiment import SweepSpec
    from llmft.katib.webhook_rules import check_experiment

    assert render_names()["toy"] == "toyjob"
    arguments = {"mlflow_tracking_uri": "http://mlflow.example:5000"}
    body = render_job(arguments, "toy", run_id="RUN-ID", namespace=None, data="/data/tok")
    assert (body["apiVersion"], body["kind"]) == (TOY.api_version, TOY.kind)
    assert body["spec"]["overrides"] == {"data": "/data/tok"}

    plan = sim_plan(sim_volume, training_backend="toyjob", run_id="run-toy-sweep")
    experiment = build_sweep_experiment(SweepSpec(name="toy-sweep"), job=plan.job, data="/data/tok").to_dict()
    trial = experiment["spec"]["trialTemplate"]["trialSpec"]
    assert trial_kind(trial) is TOY_TRIAL and "name" not in trial["metadata"]
    assert trial["spec"]["overrides"]["data"] == "/data/tok"
    template = experiment["spec"]["trialTemplate"]
    assert (template["primaryContainerName"], template["successCondition"]) == ("toy", TOY_TRIAL.success_condition)
    check_experiment(experiment)  # Katib's webhook rules accept the registered kind's trials

    template["primaryContainerName"] = "pytorch"
    with pytest.raises(Exception, match="ToyJob trials need 'toy'"):
        check_experiment(experiment)


def test_register_refuses_a_name_or_an_older_name_already_taken():
    """Issue 48.2: a second module registering ``pytorchjob`` (or ``kubeflow``, its older name) would silently have
    replaced the first; torchtitan's register_train_spec refuses the same way."""
    for name, aliases in (("pytorchjob", ()), ("rayjob", ("kubeflow",))):
        with pytest.raises(ValueError, match="already registered"):
            register(Backend(name=name, aliases=aliases, katib_trials=NO_TRIALS))
    assert backend_for("kubeflow").name == "pytorchjob" and "rayjob" not in backends.BACKENDS


def test_every_backend_states_its_katib_trial_policy_and_none_is_refused_for_a_sweep(sim_volume):
    """A backend without Katib trials of its own is refused for a Katib sweep in one line, never silently swept on
    PyTorchJobs; local's policy says so explicitly (its sweeps run PyTorchJob trials)."""
    from llmft.components.lib.jobs.katib_sweep import build_sweep_experiment, trial_backend
    from llmft.katib.experiment import SweepSpec

    assert {b.name: b.katib_trials for b in backends.BACKENDS.values()} == {
        "pytorchjob": OWN_TRIALS, "trainjob": OWN_TRIALS, "local": "pytorchjob"
    }  # fmt: skip
    assert trial_backend("local") is backend_for("pytorchjob")
    register(Backend(name="plainjob", resource=TOY, attach=lambda *a, **k: {}))  # no policy given: none
    try:
        plan = sim_plan(sim_volume, training_backend="plainjob", run_id="run-plain")
        with pytest.raises(ConfigError, match=r"^training_backend=plainjob has no Katib trials .*hpo_backend=local"):
            build_sweep_experiment(SweepSpec(name="plain-sweep"), job=plan.job, data="/data/tok")
    finally:
        backends.unregister("plainjob")
    with pytest.raises(ValueError, match="katib_trials='own' needs trial_job"):
        register(Backend(name="halfjob", katib_trials=OWN_TRIALS))
    with pytest.raises(ValueError, match="katib_trials='local' runs no trials"):
        register(Backend(name="halfjob", katib_trials="local"))


def test_the_runs_cleanup_deletes_the_registered_kind(toy, fake_cluster, fake_custom_api):
    run_id = "5d1c7a40-0b0e-4c52-9f13-6a7e5b2c9d10"
    labels = {RUN_ID_LABEL: run_label(run_id)}
    body = {"apiVersion": TOY.api_version, "kind": TOY.kind, "metadata": {"name": "toy-train", "labels": labels}}
    fake_cluster.create_custom_object(*TOY[:3], {**body, "spec": {}})

    report = cleanup_run(fake_cluster, run_id, print_fn=lambda _: None)

    assert report["deleted"] == ["ToyJob/toy-train"]
    assert not [key for key in fake_custom_api.objects if key[-1] == "toy-train"]


def test_the_local_entry_runs_the_trainer_in_the_plans_run_directory(sim_volume, monkeypatch):
    from llmft.components.lib.jobs import local_train

    plan = sim_plan(sim_volume, training_backend="local", run_id="run-local", mlflow_tracking_uri="http://m:5000")
    launch = plan.trainer.launch(f"{sim_volume}/tokenized/demo")
    seen = {}
    monkeypatch.setattr(local_train, "run_local_training", lambda launch, **kw: seen.update(launch=launch, **kw))

    backend_for("local").run_train_step(plan, launch)

    assert seen == {
        "launch": launch,
        "nproc": max(1, plan.job.num_workers),
        "log_path": f"{plan.trainer.run_dir}/train.log",
        "env": {"MLFLOW_TRACKING_URI": "http://m:5000"},
        "timeout_s": plan.job.timeout_s,
    }
    assert backend_for("local").attach is None and backend_for("local").resource is None
