"""Issue 34.3: ``serving_namespace`` other than the pipeline's. ``pvc://`` storage mounts a claim by name in
the predictor pod (kserve v0.20.0 pkg/utils/storage.go 107-115), and a pod's claim is of its own namespace,
so the data PVC must exist there; deploy/role.yaml is bound in the pipeline's namespace only, so the
deploy step may not create the InferenceService there without a RoleBinding. The plan step refuses
such a run in one line naming what is missing, before any GPU time."""

from __future__ import annotations

import pytest
from conftest import sim_plan
from k8s_fakes import FakeAuthorizationApi, FakeCoreV1Api, FakeCustomObjectsApi

from llmft.components.lib.cluster import Cluster
from llmft.components.lib.plan.checks import SERVING_VERBS, preflight_serving_namespace
from llmft.components.lib.serving.inferenceservice import mesh_denial_message
from llmft.trainer.errors import ConfigError

BOUND = {(verb, "inferenceservices", "serving") for verb in SERVING_VERBS}


def _cluster(claims=(), allowed=()) -> tuple[Cluster, FakeAuthorizationApi]:
    core, authorization = FakeCoreV1Api(), FakeAuthorizationApi(allowed)
    core.claims = set(claims)
    cluster = Cluster("team-a", custom_api=FakeCustomObjectsApi(), core_api=core, authorization_api=authorization)
    return cluster, authorization


@pytest.mark.parametrize(
    ("claims", "allowed", "shown"),
    [
        ((), (), "PVC serving/llmft-data does not exist; no RoleBinding in serving lets this service account "
                 "create/get/update inferenceservices"),
        ((("serving", "llmft-data"),), (), "no RoleBinding in serving lets this service account create/get/update"),
        ((), BOUND, "serving_namespace=serving: PVC serving/llmft-data does not exist. Create the PVC"),
    ],
    ids=["neither", "no-rolebinding", "no-pvc"],
)  # fmt: skip
def test_another_serving_namespace_without_the_pvc_or_a_rolebinding_is_refused(claims, allowed, shown, sim_volume):
    plan = sim_plan(sim_volume, run_id="run-serving-ns", serving_namespace="serving")
    cluster, _ = _cluster(claims, allowed)
    with pytest.raises(ConfigError) as refused:
        preflight_serving_namespace(plan, cluster)
    message = str(refused.value)
    assert shown in message and "\n" not in message and "leave serving_namespace empty" in message


def test_the_pvc_and_a_rolebinding_there_pass_and_the_own_namespace_is_not_checked(sim_volume):
    plan = sim_plan(sim_volume, run_id="run-serving-ns", serving_namespace="serving")
    cluster, authorization = _cluster([("serving", "llmft-data")], BOUND)
    preflight_serving_namespace(plan, cluster)
    assert sorted(authorization.reviews) == sorted(BOUND)
    own = sim_plan(sim_volume, run_id="run-serving-ns", serving_namespace="team-a")
    cluster, authorization = _cluster()
    preflight_serving_namespace(own, cluster)
    assert authorization.reviews == []


def test_the_mesh_message_names_what_serving_elsewhere_needs():
    message = mesh_denial_message("http://m.team-a.svc/openai/v1/models")
    assert "serving_namespace" in message and "needs the data PVC and a RoleBinding" in message
