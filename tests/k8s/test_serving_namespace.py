"""Issue 34.3: ``serving_namespace`` other than the pipeline's. ``pvc://`` storage mounts a claim by name in
the predictor pod (kserve v0.20.0 pkg/utils/storage.go 107-115), and a pod's claim is of its own namespace,
so the data PVC must exist there; deploy/role.yaml is bound in the pipeline's namespace only, so the
deploy step may not create the InferenceService there without a RoleBinding. The plan step refuses
such a run in one line naming what is missing, before any GPU time."""

from __future__ import annotations

import pytest
from k8s_fakes import FakeAuthorizationApi, FakeCoreV1Api, FakeCustomObjectsApi
from sim_plans import sim_plan

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


@pytest.mark.parametrize(
    ("details", "shown"),
    [
        ({"phase": "Pending"}, "PVC serving/llmft-data is Pending, not Bound"),
        ({"provisioner": "cluster.local/nfs-subdir-external-provisioner", "storage_class": "nfs-client"},
         "PVC serving/llmft-data was provisioned by cluster.local/nfs-subdir-external-provisioner (storage class "
         "nfs-client): a new, empty volume, not the pipeline's"),
        ({"access_modes": ["ReadWriteOnce"]}, "PVC serving/llmft-data is ReadWriteOnce: it needs ReadWriteMany"),
    ],
    ids=["unbound", "dynamically-provisioned", "one-node"],
)  # fmt: skip
def test_a_claim_there_that_cannot_be_the_data_volume_is_refused(details, shown, sim_volume):
    """Issue 42 (Low): a claim of the same name is not enough. A StorageClass provisions a new, empty volume for
    it (the pipeline's adapter is not there: the model load failed after the whole run); an unbound claim or a
    ReadWriteOnce one cannot be mounted beside the pipeline's pods."""
    plan = sim_plan(sim_volume, run_id="run-serving-ns", serving_namespace="serving")
    cluster, _ = _cluster([("serving", "llmft-data")], BOUND)
    cluster.core_api.claim_details[("serving", "llmft-data")] = details
    with pytest.raises(ConfigError) as refused:
        preflight_serving_namespace(plan, cluster)
    message = str(refused.value)
    assert shown in message and "\n" not in message and "a PersistentVolume of the data PVC's storage" in message


def test_a_model_load_failure_in_another_namespace_names_the_claim_and_the_likely_cause():
    from llmft.components.lib.serving.isvc_apply import load_failure_message

    body = {"metadata": {"name": "m-serve", "namespace": "serving"},
            "spec": {"predictor": {"model": {"storageUri": "pvc://llmft-data/models/m/run-1"}}}}  # fmt: skip
    message = load_failure_message(body, "BlockedByFailedLoad: ModelLoadFailed adapter_config.json not found", "team-a")
    assert "\n" not in message and "InferenceService serving/m-serve failed to load the model" in message
    assert "It reads pvc://llmft-data/models/m/run-1 (PVC serving/llmft-data)" in message
    assert "serves in namespace serving, not the pipeline's team-a" in message and "new, empty volume" in message
    same = load_failure_message({**body, "metadata": {"name": "m-serve", "namespace": "team-a"}}, "x", "team-a")
    assert "Likely cause" not in same and "kubectl logs -n team-a -l serving.kserve.io/inferenceservice=m-serve" in same
