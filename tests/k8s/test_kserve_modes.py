"""Issue 42.1: the deploy step's InferenceService is admitted by every KServe release the cluster guide names
(v0.15.0-v0.20.0), in Knative (Serverless, KServe's default) and in raw (Standard/RawDeployment) mode, on a
first deploy and on a redeploy; a raw redeploy replaces the pod first (no spare GPU), a Knative one says it
needs a spare GPU. KServe's webhooks and controller per release: tests/k8s/kserve_admission.py (cited there).

Before, every body carried ``predictor.deploymentStrategy``, which KServe's validating webhook refuses outside
raw mode: create and replace failed with HTTP 400 on a default install."""

from __future__ import annotations

import copy

import pytest
import yaml
from k8s_fakes import FakeCustomObjectsApi
from kserve_admission import KPA_REFUSAL, RELEASES, KServe, defaults_of

from llmft.components.lib.cluster import Cluster, ClusterError
from llmft.components.lib.serving.deployment import DeployRequest, inference_service_body, write_manifest
from llmft.components.lib.serving.deployment_mode import MODE_ANNOTATION, read_mode, redeploy_body
from llmft.components.lib.serving.isvc_apply import deploy_inference_service
from llmft.trainer.errors import ConfigError

CASES = [(tag, default) for tag in RELEASES for default in defaults_of(tag)]
KEY = ("serving.kserve.io", "v1beta1", "team-a", "inferenceservices", "m-serve")


def _request(**change) -> DeployRequest:
    fields = dict(adapter_dir="/data/models/m/run-1", base_model="org/base", adapter_name="m", version="2",
                  deploy=True, mode="kserve", name="m-serve", namespace="team-a", gpus=1, max_lora_rank=16,
                  pvc_name="llmft-data", data_root="/data")  # fmt: skip
    return DeployRequest(**{**fields, **change})


def _cluster(release: str, default: str) -> tuple[Cluster, FakeCustomObjectsApi, KServe]:
    custom = FakeCustomObjectsApi()
    kserve = KServe(release, default).install(custom)
    return Cluster("team-a", custom_api=custom, core_api=_NoPods()), custom, kserve


class _NoPods:
    """The predictor's pods as the deploy step lists them (none Pending)."""

    def list_namespaced_pod(self, namespace, label_selector=None, **_):
        from kubernetes import client

        return client.V1PodList(items=[])


def _deploy(cluster: Cluster, body: dict, printed: list) -> dict:
    return deploy_inference_service(cluster, copy.deepcopy(body), timeout_s=5, poll_s=0.001, print_fn=printed.append)


@pytest.mark.parametrize(("release", "default"), CASES, ids=[f"{r}-{d}" for r, d in CASES])
def test_every_release_and_mode_admits_the_first_deploy_and_the_redeploy(release, default, isvc_crd_errors):
    cluster, custom, kserve = _cluster(release, default)
    first = inference_service_body(_request(adapter_dir="/data/models/m/run-1"))
    printed: list[str] = []
    created = _deploy(cluster, first, printed)
    raw = kserve.default in ("RawDeployment", "Standard")
    assert created["deployment_mode"] == (kserve.default if raw else "Knative")
    assert kserve.ran[("m-serve", 1)] == (kserve.default, "RollingUpdate" if raw else "Revision")

    second = inference_service_body(_request(adapter_dir="/data/models/m/run-2"))
    redeployed = _deploy(cluster, second, printed)
    assert kserve.denied == [], kserve.denied
    assert redeployed["generation"] == 2
    stored = custom.objects[KEY]
    assert stored["spec"]["predictor"]["model"]["storageUri"].endswith("models/m/run-2")
    strategy = stored["spec"]["predictor"].get("deploymentStrategy")
    assert strategy == ({"type": "Recreate"} if raw else None)
    assert kserve.ran[("m-serve", 2)] == (kserve.default, "Recreate" if raw else "Revision")
    assert [isvc_crd_errors(body) for body in custom.sent("inferenceservices")] == [[], [], []]  # create, 409, replace
    created_line, replaced_line = (line for line in printed if line.startswith("InferenceService "))
    recorded = kserve.default if raw or kserve.release.status_mode else "Knative"  # v0.15.0: no status mode
    assert f"created in {kserve.default if raw else 'Knative'} mode" in created_line
    assert f"replaced in {recorded} mode" in replaced_line
    if raw:
        assert "no spare GPU is needed" in replaced_line
    else:
        assert "needs 1 free GPU until it is Ready" in replaced_line and "Redeploying" in replaced_line


@pytest.mark.parametrize("release", list(RELEASES))
def test_a_deployment_strategy_outside_raw_mode_is_refused_as_before(release):
    """The rule the old body broke: every body carried deploymentStrategy; on KServe's default (Serverless)
    each release's webhook refuses it, on create as on replace."""
    cluster, custom, kserve = _cluster(release, "Serverless")
    body = inference_service_body(_request())
    body["spec"]["predictor"]["deploymentStrategy"] = {"type": "Recreate"}  # what the deploy step sent before
    with pytest.raises(ClusterError, match=KPA_REFUSAL) as refused:
        cluster.create_custom_object(*KEY[:2], "inferenceservices", body)
    assert refused.value.status == 400 and kserve.denied == [KPA_REFUSAL]


@pytest.mark.parametrize(
    ("release", "spelling", "admitted"),
    [("v0.15.2", "RawDeployment", True), ("v0.15.2", "Standard", False), ("v0.16.0", "RawDeployment", False),
     ("v0.16.0", "Standard", True), ("v0.17.0", "RawDeployment", True), ("v0.20.0", "RawDeployment", True)],
)  # fmt: skip
def test_no_one_spelling_of_raw_mode_takes_a_strategy_on_every_release(release, spelling, admitted):
    """Why the step never names the mode itself: v0.15 knows only RawDeployment, v0.16.0 treats only Standard
    as raw and does not rewrite RawDeployment (v0.17.0 onwards does)."""
    cluster, _, kserve = _cluster(release, "Serverless")
    body = inference_service_body(_request())
    body["metadata"]["annotations"] = {MODE_ANNOTATION: spelling}
    body["spec"]["predictor"]["deploymentStrategy"] = {"type": "Recreate"}
    try:
        cluster.create_custom_object(*KEY[:2], "inferenceservices", body)
    except ClusterError:
        assert not admitted and kserve.denied == [KPA_REFUSAL]
    else:
        assert admitted


def test_an_explicit_mode_on_a_raw_default_cluster_is_kept_on_redeploy():
    """An InferenceService the user made Knative on a cluster whose default is raw: a replace without the
    annotation would get the raw default from the webhook and be refused ("cannot be changed"); the step
    sends the recorded mode back."""
    cluster, custom, kserve = _cluster("v0.17.0", "Standard")
    first = inference_service_body(_request())
    first["metadata"]["annotations"] = {MODE_ANNOTATION: "Knative"}
    _deploy(cluster, first, [])
    printed: list[str] = []
    _deploy(cluster, inference_service_body(_request(adapter_dir="/data/models/m/run-2")), printed)
    assert kserve.denied == [] and custom.objects[KEY]["metadata"]["annotations"] == {MODE_ANNOTATION: "Knative"}
    assert "deploymentStrategy" not in custom.objects[KEY]["spec"]["predictor"]


def test_a_refused_strategy_falls_back_to_a_replace_without_it():
    """An InferenceService made by KServe v0.15 keeps status RawDeployment after an upgrade to v0.16.0, whose
    validator takes only Standard as raw: the replace with a strategy is refused, the step replaces without
    it and says the rollout needs a free GPU."""
    cluster, custom, kserve = _cluster("v0.16.0", "Standard")
    _deploy(cluster, inference_service_body(_request()), [])
    custom.objects[KEY]["status"]["deploymentMode"] = "RawDeployment"
    custom.objects[KEY]["metadata"]["annotations"] = {MODE_ANNOTATION: "RawDeployment"}
    kserve.reconcile = lambda isvc: isvc["status"].update(observedGeneration=isvc["metadata"]["generation"])
    printed: list[str] = []
    _deploy(cluster, inference_service_body(_request(adapter_dir="/data/models/m/run-2")), printed)
    assert kserve.denied == [KPA_REFUSAL]
    assert any("KServe refused deploymentStrategy Recreate" in line and "1 free GPU" in line for line in printed)
    assert custom.objects[KEY]["spec"]["predictor"]["model"]["storageUri"].endswith("run-2")


@pytest.mark.parametrize(
    ("status", "annotation", "mode", "raw"),
    [("Standard", "Standard", "Standard", True), (None, "RawDeployment", "RawDeployment", True),
     ("Knative", None, "Knative", False), (None, None, "", False)],
)  # fmt: skip
def test_the_mode_is_read_from_the_status_then_the_annotation(status, annotation, mode, raw):
    existing = {"metadata": {"annotations": {MODE_ANNOTATION: annotation} if annotation else {}},
                "spec": {"predictor": {}}, "status": {"deploymentMode": status} if status else {}}  # fmt: skip
    body = {"metadata": {"name": "m"}, "spec": {"predictor": {"deploymentStrategy": {"type": "Recreate"}}}}
    sent, read = redeploy_body(body, existing, "Recreate")
    assert read == read_mode(existing) and read.value == mode and read.raw is raw
    assert ("deploymentStrategy" in sent["spec"]["predictor"]) is raw
    assert (sent["metadata"].get("annotations") or {}).get(MODE_ANNOTATION) == (mode or None)


def test_a_knative_redeploy_without_a_free_gpu_times_out_naming_the_pending_pod_and_the_fix():
    cluster, custom, kserve = _cluster("v0.20.0", "Serverless")
    _deploy(cluster, inference_service_body(_request()), [])
    kserve.reconcile = lambda isvc: isvc["status"].update(  # the new Revision never becomes Ready
        conditions=[{"type": "Ready", "status": "False", "reason": "RevisionMissing"}]
    )
    cluster._core_api = _PendingPredictor()
    printed: list[str] = []
    with pytest.raises(TimeoutError) as timed_out:
        deploy_inference_service(cluster, inference_service_body(_request(adapter_dir="/data/models/m/run-2")),
                                 timeout_s=0.05, poll_s=0.001, print_fn=printed.append, pending_every=1)  # fmt: skip
    message = str(timed_out.value)
    assert "Insufficient nvidia.com/gpu" in message and "a Knative redeploy starts its new Revision" in message
    assert "needs its own GPU beside the serving Revision" in message and "\n" not in message


class _PendingPredictor(_NoPods):
    def list_namespaced_pod(self, namespace, label_selector=None, **_):
        from kubernetes import client

        assert label_selector == "serving.kserve.io/inferenceservice=m-serve"
        message = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
        condition = client.V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable", message=message)
        status = client.V1PodStatus(phase="Pending", conditions=[condition])
        pod = client.V1Pod(metadata=client.V1ObjectMeta(name="m-serve-predictor-00002-deployment-x"), status=status)
        return client.V1PodList(items=[pod])


def test_the_manifest_carries_no_mode_and_a_rollout_is_checked(tmp_path, crd_dir):
    path = tmp_path / "isvc.yaml"
    write_manifest(inference_service_body(_request()), path, crd_dir=str(crd_dir))
    manifest = yaml.safe_load(path.read_text())
    assert "deploymentStrategy" not in manifest["spec"]["predictor"]
    assert MODE_ANNOTATION not in (manifest["metadata"].get("annotations") or {})
    with pytest.raises(ConfigError, match="rollout 'Surge': use one of Recreate, RollingUpdate"):
        inference_service_body(_request(rollout="Surge"))


def test_a_rolling_update_is_asked_for_on_a_raw_redeploy():
    cluster, custom, kserve = _cluster("v0.20.0", "Standard")
    _deploy(cluster, inference_service_body(_request()), [])
    printed: list[str] = []
    deploy_inference_service(cluster, inference_service_body(_request(adapter_dir="/data/models/m/run-2")),
                             timeout_s=5, poll_s=0.001, print_fn=printed.append, rollout="RollingUpdate")  # fmt: skip
    assert kserve.ran[("m-serve", 2)] == ("Standard", "RollingUpdate")
    assert any("the new pod needs a free GPU before the old one goes" in line for line in printed)
