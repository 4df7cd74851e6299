"""Issue 42 (Low: grace period): a training pod gets the time its SIGTERM checkpoint needs. Kubernetes' default
``terminationGracePeriodSeconds`` is 30 s, then SIGKILL; a checkpoint that takes longer is lost. The plan sizes
the grace from the checkpoint it estimates (llmft/components/lib/plan/volume_space.py) and a stated write rate
(llmft/components/lib/jobs/grace.py), and every training pod carries it: PyTorchJob replicas, TrainJob nodes
and Katib trials."""

from __future__ import annotations

import math

import pytest
from sim_plans import sim_plan
from trainer_v2_sim import make_plan

from llmft.components.lib.contracts.schema import UNKNOWN_GRACE_S
from llmft.components.lib.jobs.backends import backend_for
from llmft.components.lib.jobs.grace import CHECKPOINT_WRITE_BYTES_PER_S, STOP_S, grace_period_s
from llmft.components.lib.jobs.pytorchjob_spec import build_job_spec
from llmft.components.lib.plan.volume_space import run_footprint


def test_the_grace_is_the_stop_plus_the_checkpoints_write_time():
    assert grace_period_s(None) == UNKNOWN_GRACE_S
    assert grace_period_s(0) == STOP_S
    full_8b = 12 * 8_000_000_000  # float32 weights and two AdamW moments per trained parameter
    assert grace_period_s(full_8b) == STOP_S + math.ceil(full_8b / CHECKPOINT_WRITE_BYTES_PER_S) == 1036
    assert grace_period_s(full_8b) > 30, "Kubernetes' default would SIGKILL the commit"


def test_the_plan_sizes_the_grace_from_the_models_checkpoint(sim_volume):
    plan = sim_plan(sim_volume, run_id="run-grace")  # the tiny model is on the volume: its config.json is read
    footprint, why_not = run_footprint(plan, plan.trainer.config)
    assert footprint is not None, why_not
    assert plan.job.termination_grace_s == grace_period_s(footprint.checkpoint)


def test_a_model_the_plan_cannot_read_gets_the_unknown_grace():
    plan = make_plan(base_model="org/not-in-the-cache")
    assert plan.job.termination_grace_s == UNKNOWN_GRACE_S


def _pod_specs(body: dict) -> list[dict]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "containers" in node and isinstance(node["containers"], list):
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(body)
    return found


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob"])
def test_every_training_pod_and_trial_carries_the_grace(backend):
    plan = make_plan(training_backend=backend, training_workers=2)
    spec = build_job_spec(plan.job, plan.trainer.launch("/data/tokenized/k"))
    job, trial = (
        backend_for(backend).build_job(plan.job, spec),
        backend_for(backend).build_trial_job(plan.job, spec, True),
    )
    for body in (job, trial):
        pods = _pod_specs(body)
        assert pods and all(p.get("terminationGracePeriodSeconds") == UNKNOWN_GRACE_S for p in pods), pods
