"""The thin cluster module: namespace discovery, lazy configuration, calls and errors."""

from __future__ import annotations

import pytest
import yaml
from k8s_fakes import FakeCoreV1Api, FakeCustomObjectsApi

from llmft.components.lib.cluster import Cluster, ClusterError, current_namespace
from llmft.trainer.errors import LlmftError

G, V, P = "kubeflow.org", "v1beta1", "experiments"


def _kubeconfig(path, namespace=None):
    context = {"cluster": "c", "user": "u", **({"namespace": namespace} if namespace else {})}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "ctx",
                "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443"}}],
                "contexts": [{"name": "ctx", "context": context}],
                "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
            }
        )
    )
    return path


def test_namespace_comes_from_the_service_account_first(tmp_path):
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "namespace").write_text("kubeflow-user\n")
    kubeconfig = _kubeconfig(tmp_path / "config", namespace="from-kubeconfig")
    assert current_namespace(sa, str(kubeconfig)) == "kubeflow-user"


def test_namespace_falls_back_to_kubeconfig_context_then_default(tmp_path):
    no_sa = tmp_path / "absent"
    assert current_namespace(no_sa, str(_kubeconfig(tmp_path / "a", namespace="ml-team"))) == "ml-team"
    assert current_namespace(no_sa, str(_kubeconfig(tmp_path / "b"))) == "default"
    assert current_namespace(no_sa, str(tmp_path / "missing-kubeconfig")) == "default"


def test_configuration_is_loaded_lazily_from_kubeconfig(tmp_path):
    cluster = Cluster(
        config_file=str(_kubeconfig(tmp_path / "config", namespace="ml-team")), service_account_dir=tmp_path / "absent"
    )
    assert cluster._api_client is None, "nothing is loaded at construction"
    assert cluster.namespace == "ml-team"
    assert cluster.api_client.configuration.host == "https://10.0.0.1:6443"
    assert cluster.custom_api.api_client is cluster.api_client


def test_missing_configuration_is_a_clear_error(tmp_path):
    cluster = Cluster("ns", config_file=str(tmp_path / "nope"), service_account_dir=tmp_path / "absent")
    with pytest.raises(ClusterError, match="cannot load Kubernetes configuration.*KUBECONFIG") as err:
        _ = cluster.custom_api
    assert isinstance(err.value, LlmftError)


def test_custom_object_round_trip_uses_default_and_explicit_namespace(fake_cluster, fake_custom_api):
    body = {
        "apiVersion": f"{G}/{V}",
        "kind": "Experiment",
        "metadata": {"name": "sweep", "labels": {"a": "b"}},
        "spec": {"maxTrialCount": 4},
    }
    created = fake_cluster.create_custom_object(G, V, P, body)
    assert created["metadata"]["namespace"] == "team-a"
    assert fake_cluster.get_custom_object(G, V, P, "sweep")["spec"] == {"maxTrialCount": 4}
    patched = fake_cluster.patch_custom_object(G, V, P, "sweep", {"spec": {"parallelTrialCount": 2}})
    assert patched["spec"] == {"maxTrialCount": 4, "parallelTrialCount": 2}
    replaced = fake_cluster.replace_custom_object(G, V, P, "sweep", {**patched, "spec": {"maxTrialCount": 8}})
    assert replaced["spec"] == {"maxTrialCount": 8} and replaced["metadata"]["generation"] == 2
    assert [o["metadata"]["name"] for o in fake_cluster.list_custom_objects(G, V, P, label_selector="a=b")] == ["sweep"]
    assert fake_cluster.list_custom_objects(G, V, P, namespace="other") == []
    fake_cluster.delete_custom_object(G, V, P, "sweep")
    assert fake_custom_api.objects == {}


@pytest.mark.parametrize("status, hint", [(404, "CRD is not installed"), (409, "already exists"), (403, "RBAC")])
def test_api_errors_become_cluster_errors_with_status_and_fix(status, hint):
    from k8s_fakes import api_error

    class Refusing(FakeCustomObjectsApi):
        def create_namespaced_custom_object(self, *args, **kwargs):
            raise api_error(status, "server says no")

    cluster = Cluster("team-a", custom_api=Refusing(), core_api=FakeCoreV1Api())
    with pytest.raises(ClusterError) as err:
        cluster.create_custom_object(G, V, P, {"metadata": {"name": "x"}})
    assert err.value.status == status
    message = str(err.value)
    assert "create experiments.kubeflow.org/v1beta1 team-a/x" in message
    assert "server says no" in message and hint in message


def test_pods_and_logs(fake_cluster, fake_core_api):
    fake_core_api.add_pod("team-a", "p-0", {"job": "j", "role": "master"}, log="a\nb\nc\n")
    fake_core_api.add_pod("team-a", "p-1", {"job": "j", "role": "worker"}, phase="Pending")
    assert [p.metadata.name for p in fake_cluster.list_pods("job=j")] == ["p-0", "p-1"]
    assert [p.metadata.name for p in fake_cluster.list_pods("job=j,role=master")] == ["p-0"]
    assert fake_cluster.read_pod_log("p-0", container="pytorch", tail_lines=2) == "b\nc"
    with pytest.raises(ClusterError, match="waiting to start") as err:
        fake_cluster.read_pod_log("p-1")
    assert err.value.status == 400


def test_training_client_goes_through_the_same_api_objects(fake_cluster, fake_custom_api, fake_core_api):
    training = fake_cluster.training_client()
    assert training.custom_api is fake_custom_api and training.core_api is fake_core_api
    assert training.namespace == "team-a" and training.job_kind == "PyTorchJob"
    with pytest.raises(RuntimeError, match="team-a/absent"):
        training.get_job("absent")
