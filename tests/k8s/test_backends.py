"""One registry of training backends (llmft/components/lib/jobs/backends.py, issue 38.2): a backend is one module
plus one ``register`` call. A toy backend registered here, and nowhere else, is reached by the train step's
dispatch, the sweep's trial building (and Katib's trial-kind rules), render-job and the run's cleanup."""

from __future__ import annotations

import pytest
from sim_plans import sim_plan

from llmft.components.lib import cluster as cluster_module
from llmft.components.lib.contracts.schema import RUN_ID_LABEL, run_label
from llmft.components.lib.jobs import backends
from llmft.components.lib.jobs.backends import (
    NO_TRIALS,
    OWN_TRIALS,
    Backend,
    backend_for,
    register,
    render_names,
    run_resources,
)
from llmft.components.lib.jobs.cleanup import cleanup_run
from llmft.katib.trial_kinds import TRIAL_KINDS, JobResource, TrialKind, trial_kind
from llmft.trainer.errors import ConfigError

TOY = JobResource("toy.example.org", "v1", "toyjobs", "ToyJob")
TOY_TRIAL = TrialKind(
    resource=TOY,
    primary_container_name="toy",
    primary_pod_labels={"toy.example.org/role": "leader"},
    success_condition='status.conditions.#(type=="Done")#|#(status=="True")#',
    failure_condition='status.conditions.#(type=="Failed")#|#(status=="True")#',
    container_rule="spec.command must hold the trainer's command",
    find_command=lambda job: job["spec"] if job["spec"].get("command") else None,
)


def _toy_body(job, spec) -> dict:
    return {
        "apiVersion": TOY.api_version,
        "kind": TOY.kind,
        "metadata": {"name": spec.name, "labels": dict(spec.labels)},
        "spec": {"image": spec.image, "command": ["llmft", "train"], "overrides": dict(spec.overrides)},
    }


@pytest.fixture
def toy(monkeypatch):
    """The toy backend, registered; its ``training_backend`` value accepted by the plan's checks."""
    calls: list[tuple] = []

    def attach(job, launch, **options):
        calls.append((job.name, launch.config_path, dict(launch.overrides), options["owner"]))
        return {"name": job.name, "succeeded": True}

    def trial_job(job, spec, early_stopping):
        body = _toy_body(job, spec)
        del body["metadata"]["name"]
        return body

    backend = Backend(
        name="toyjob", render_name="toy", resource=TOY, trial_kind=TOY_TRIAL, build=_toy_body, trial_job=trial_job,
        katib_trials=OWN_TRIALS, attach=attach,
    )  # fmt: skip
    register(backend)
    try:
        yield calls
    finally:
        backends.unregister("toyjob")
    assert (TOY.api_version, TOY.kind) not in TRIAL_KINDS, "unregister takes its trial kind back"


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


def test_the_train_step_dispatches_to_a_registered_backend(toy, sim_volume, fake_cluster, monkeypatch):
    plan = sim_plan(sim_volume, training_backend="toyjob", run_id="run-toy")
    monkeypatch.setattr(cluster_module, "Cluster", lambda *a, **k: fake_cluster)  # no kube config here
    launch = plan.trainer.launch(f"{sim_volume}/tokenized/demo", ["lora.r=8"])

    result = backend_for(plan.job.backend).run_train_step(plan, launch)  # llmft/components/train.py's line

    assert result == {"name": plan.job.name, "succeeded": True}
    assert toy == [(plan.job.name, plan.trainer.config_path, {"data": f"{sim_volume}/tokenized/demo", "lora.r": "8"},
                    None)]  # fmt: skip


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
