"""The plan step's TrainJob runtime preflight (llmft/components/lib/jobs/trainjob_runtime.py) through the Kubeflow
SDK's own ``KubernetesBackend.get_runtime`` (PyPI kubeflow 0.5.0, ``kubeflow/trainer/backends/kubernetes/
backend.py`` 183-232: namespaced TrainingRuntime first, ClusterTrainingRuntime only after a 404) against
fakes at the kubernetes-client boundary that answer as the API server does: 403 when RBAC does not grant
the read, 404 when the CRD is not served, no answer (the client's async ``get`` times out)."""

from __future__ import annotations

import copy

import pytest
import yaml
from trainer_v2_sim import FakeTrainerCoreApi, FakeTrainerCustomApi, load_runtime, make_plan

from llmft.components.lib.cluster import Cluster
from llmft.components.lib.jobs.backends import backend_for
from llmft.components.lib.jobs.trainjob_launch import run_trainjob
from llmft.components.lib.jobs.trainjob_runtime import RBAC_FILES, preflight_runtime
from llmft.components.lib.jobs.trainjob_spec import GROUP, PLURAL, VERSION
from llmft.trainer.errors import EXIT_TRANSIENT, EXIT_USER_ERROR, ConfigError, TransientError

NS = "team-a"
RUNTIME = "torch-distributed"


def _cluster(crd_dir, *, forbidden=(), unserved=(), unanswered=(), runtimes=("torch_distributed",), shadow=False):
    objects = {}
    for file_name in runtimes:
        runtime = load_runtime(crd_dir, file_name)
        objects[("clustertrainingruntimes", runtime["metadata"]["name"])] = runtime
    custom = FakeTrainerCustomApi(objects)
    custom.forbidden, custom.unserved, custom.unanswered = set(forbidden), set(unserved), set(unanswered)
    if shadow:  # a namespaced copy under the same name
        namespaced = copy.deepcopy(load_runtime(crd_dir, "torch_distributed"))
        namespaced["kind"] = "TrainingRuntime"
        namespaced["metadata"]["namespace"] = NS
        custom.objects[(GROUP, VERSION, NS, "trainingruntimes", RUNTIME)] = namespaced
    return Cluster(NS, custom_api=custom, core_api=FakeTrainerCoreApi())


def _preflight(cluster, **changes):
    preflight_runtime(make_plan(training_backend="trainjob", **changes), cluster)


def test_a_readable_torch_runtime_passes(crd_dir):
    cluster = _cluster(crd_dir)
    _preflight(cluster)
    assert ("get-cluster", GROUP, VERSION, "clustertrainingruntimes", RUNTIME) in cluster.custom_api.calls


def test_a_forbidden_cluster_runtime_names_the_verb_the_resource_and_the_file_that_grants_it(crd_dir):
    """The standalone KFP + Trainer case: the Role grants trainingruntimes, nothing grants the cluster-scoped
    resource (upstream binds it to system:authenticated only in kubeflow/trainer v2.3.0
    manifests/overlays/kubeflow-platform/kubeflow-trainer-roles.yaml 83-108)."""
    with pytest.raises(ConfigError) as caught:
        _preflight(_cluster(crd_dir, forbidden={"clustertrainingruntimes"}))
    message = str(caught.value)
    assert "forbidden (HTTP 403)" in message and "not installed" not in message
    assert "`get` clustertrainingruntimes.trainer.kubeflow.org at the cluster scope" in message
    assert "Apply deploy/cluster-role.yaml" in message and "\n" not in message
    assert caught.value.exit_code == EXIT_USER_ERROR


def test_a_forbidden_namespaced_read_stops_the_sdk_before_the_cluster_runtime(crd_dir):
    """backend.py 203-207: a non-404 on the namespaced read is raised, the cluster runtime never read."""
    cluster = _cluster(crd_dir, forbidden={"trainingruntimes"})
    with pytest.raises(ConfigError, match=r"`get` trainingruntimes\.trainer\.kubeflow\.org in namespace team-a"):
        _preflight(cluster)
    assert not [c for c in cluster.custom_api.calls if c[0] == "get-cluster"]
    with pytest.raises(ConfigError, match=r"reads the namespaced TrainingRuntime first\)\. Apply deploy/role\.yaml"):
        _preflight(cluster)


def test_trainer_not_installed_is_told_apart_from_forbidden_and_from_a_missing_runtime(crd_dir):
    no_crd = _cluster(crd_dir, unserved={"trainingruntimes", "clustertrainingruntimes"})
    with pytest.raises(ConfigError, match="Kubeflow Trainer v2 is not installed") as caught:
        _preflight(no_crd)
    assert "forbidden" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"ClusterTrainingRuntime/torch-distributed does not exist"):
        _preflight(_cluster(crd_dir, runtimes=()))


def test_a_namespaced_runtime_that_shadows_the_cluster_runtime_is_refused_with_both_fixes(crd_dir):
    """The SDK returns the namespaced runtime (backend.py 185-197) and reads it again on every status poll
    (get_job -> __get_trainjob_from_cr, 673), while the TrainJob runs the ClusterTrainingRuntime it names."""
    cluster = _cluster(crd_dir, shadow=True)
    with pytest.raises(ConfigError) as caught:
        _preflight(cluster)
    message = str(caught.value)
    assert f"TrainingRuntime {NS}/{RUNTIME} shadows ClusterTrainingRuntime {RUNTIME}" in message
    assert f"training_runtime=TrainingRuntime/{RUNTIME}" in message
    _preflight(cluster, training_runtime=f"TrainingRuntime/{RUNTIME}")  # asking for the namespaced one is fine


def test_the_sdks_timeout_is_a_one_line_transient_error(crd_dir):
    """backend.py 199-202: the client's async get times out -> the SDK raises TimeoutError."""
    with pytest.raises(TransientError, match="did not answer within the Kubeflow SDK's timeout") as caught:
        _preflight(_cluster(crd_dir, unanswered={"trainingruntimes"}))
    assert caught.value.exit_code == EXIT_TRANSIENT and "\n" not in str(caught.value)


def test_an_api_timeout_during_the_wait_is_not_reported_as_the_job_timing_out(crd_dir):
    """get_job times out (backend.py 437-440) or its get_runtime does: a transient fault, not JobTimedOut."""
    from llmft.components.lib.jobs.pytorchjob_spec import build_job_spec
    from llmft.components.lib.jobs.trainjob_spec import build_trainjob

    cluster = _cluster(crd_dir)
    plan = make_plan(training_backend="trainjob")
    job = build_trainjob(build_job_spec(plan.job, plan.trainer.launch("/data/tokenized/x")), runtime=plan.job.runtime)

    def stall(obj, count):  # after the submit, the server stops answering
        cluster.custom_api.unanswered.add(PLURAL)

    cluster.custom_api.on_get = stall
    with pytest.raises(TransientError, match="the Kubernetes API did not answer"):
        run_trainjob(cluster, job, timeout_s=5, poll_s=0.01, print_fn=lambda _: None)


def test_the_pytorchjob_backend_reads_no_runtime(crd_dir):
    """The preflight is the registry's (issue 48.2): only the trainjob entry has one, no backend name is compared."""
    cluster = _cluster(crd_dir, forbidden={"trainingruntimes", "clustertrainingruntimes"})
    plan = make_plan(training_backend="pytorchjob")
    backend_for(plan.job.backend).check_preflight(plan, cluster)
    assert backend_for("pytorchjob").preflight is None and backend_for("trainjob").preflight is preflight_runtime
    assert cluster.custom_api.calls == []


@pytest.mark.parametrize("resource", sorted(RBAC_FILES))
def test_the_file_each_message_names_grants_that_read(repo_root, resource):
    granted = set()
    for obj in yaml.safe_load_all((repo_root / RBAC_FILES[resource]).read_text()):
        for rule in (obj or {}).get("rules") or []:
            if "trainer.kubeflow.org" in rule["apiGroups"] and resource in rule["resources"]:
                granted |= set(rule["verbs"])
    assert {"get", "list"} <= granted
