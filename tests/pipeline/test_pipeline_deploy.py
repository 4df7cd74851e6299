"""The deploy step's logic: servability first, a CRD-valid manifest, then local check or KServe."""

from __future__ import annotations

import json

import pytest
import yaml
from adapter_helpers import deploy_request, peft_adapter
from k8s_fakes import FakeCoreV1Api, FakeCustomObjectsApi

from llmft.components.lib.cluster import Cluster
from llmft.components.lib.serving.deployment import crd_schema_errors, deploy_promoted
from llmft.components.lib.serving.local_check import AdapterHasNoEffectError
from llmft.components.lib.serving.servability import AdapterNotServableError
from llmft.trainer.errors import ConfigError

pytestmark = pytest.mark.slow  # a trained adapter, generation and a fake KServe HTTP server


@pytest.fixture(scope="module")
def volume(tmp_path_factory, tiny_model_dir):
    """A stand-in for the PVC: base model and promoted adapters under one root."""
    import shutil

    root = tmp_path_factory.mktemp("volume")
    shutil.copytree(tiny_model_dir, root / "base-models" / "tiny")
    peft_adapter(tiny_model_dir, root / "models" / "m" / "trained")
    peft_adapter(tiny_model_dir, root / "models" / "m" / "untrained", trained=False)
    peft_adapter(tiny_model_dir, root / "models" / "m" / "dora", dora=True)
    return root


def test_manifest_is_written_and_matches_the_crd(volume, tmp_path, crd_dir):
    path = tmp_path / "isvc.yaml"
    result = deploy_promoted(deploy_request(volume, "trained", deploy=False), manifest_path=path, crd_dir=str(crd_dir))
    assert result["status"] == "manifest-only" and result["schema_validated"] and result["servable"]
    isvc = yaml.safe_load(path.read_text())
    assert crd_schema_errors(isvc, crd_dir / "serving.kserve.io_inferenceservices.yaml") == []
    model = isvc["spec"]["predictor"]["model"]
    assert model["storageUri"] == "pvc://llmft-data"  # base and adapter share the volume root
    assert "m=/mnt/models/models/m/trained" in model["args"] and "--backend=vllm" in model["args"]
    assert "--model_dir=/mnt/models/base-models/tiny" in model["args"]
    assert isvc["metadata"]["labels"]["llmft/model-version"] == "3"


def test_local_mode_generates_with_and_without_the_adapter(volume, tmp_path):
    result = deploy_promoted(deploy_request(volume, "trained"), manifest_path=tmp_path / "isvc.yaml")
    assert result["status"] == "checked-locally"
    (sample,) = result["samples"]
    assert sample["prompt"] == "What is the capital of France?"
    assert isinstance(sample["base"], str) and isinstance(sample["adapter"], str)


def test_local_mode_fails_when_the_adapter_changes_nothing(volume, tmp_path):
    with pytest.raises(AdapterHasNoEffectError, match="changes nothing"):
        deploy_promoted(deploy_request(volume, "untrained"), manifest_path=tmp_path / "isvc.yaml")


def test_unservable_adapter_is_refused_before_any_manifest(volume, tmp_path):
    path = tmp_path / "isvc.yaml"
    with pytest.raises(AdapterNotServableError, match="DoRA"):
        deploy_promoted(deploy_request(volume, "dora"), manifest_path=path)
    with pytest.raises(AdapterNotServableError, match="exceeds max_lora_rank"):
        deploy_promoted(deploy_request(volume, "trained", max_lora_rank=1), manifest_path=path)
    assert not path.exists()


@pytest.fixture
def kserve(volume, tmp_path):
    """A Cluster whose KServe is simulated (tests/k8s/cluster_sim.py): the InferenceService turns Ready
    and its predictor is a fake vLLM server answering with the real tiny model and adapter."""
    from cluster_sim import ClusterSim

    custom, core = FakeCustomObjectsApi(), FakeCoreV1Api()
    sim = ClusterSim(custom, core, "team-a", tmp_path / "pods", volumes={"llmft-data": volume})
    yield Cluster("team-a", custom_api=custom, core_api=core), custom, sim
    sim.stop()


def test_kserve_serves_base_and_adapter_under_their_own_names(volume, tmp_path, crd_dir, kserve):
    """Item 4: `--model_name=<name>-base`, `--lora-modules <name>=...`; the smoke test finds the base in
    KServe's /openai/v1/models (which lists the base name once per registered name, never the adapter's:
    issue 33 item 3) and gets a different greedy completion from the adapter than from the base."""
    from kserve_admission import KServe

    cluster, custom, sim = kserve
    webhooks = KServe("v0.20.0", "Serverless").install_webhooks(custom)  # KServe's default install (issue 42.1)
    path = tmp_path / "isvc.yaml"
    result = deploy_promoted(deploy_request(volume, "trained", mode="kserve"), manifest_path=path, cluster=cluster,
                             crd_dir=str(crd_dir))  # fmt: skip
    assert webhooks.denied == [] and result["deployment_mode"] == "Knative"
    assert result["status"] == "deployed" and result["base_name"] == "m-base" and result["lora_name"] == "m"
    (applied,) = custom.created("inferenceservices")
    assert applied["spec"] == yaml.safe_load(path.read_text())["spec"]  # what was validated is what was applied
    args = applied["spec"]["predictor"]["model"]["args"]
    assert "--model_name=m-base" in args and args[args.index("--lora-modules") + 1].startswith("m=")
    smoke = result["smoke_test"]
    assert smoke["models"] == ["m-base"]
    (server,) = sim.servers.values()
    assert server.listing() == ["m-base", "m-base"] and server.registered() == ["m-base", "m"]
    assert [r["model"] for r in server.requests] == ["m", "m-base"]
    assert all(r["temperature"] == 0 for r in server.requests)
    json.dumps(result)  # deployment.json must be serialisable


def test_an_adapter_that_changes_nothing_fails_the_kserve_smoke_test(volume, tmp_path, kserve):
    cluster, _, _ = kserve
    with pytest.raises(RuntimeError, match="answered exactly like the base model"):
        deploy_promoted(
            deploy_request(volume, "untrained", mode="kserve"), manifest_path=tmp_path / "i.yaml", cluster=cluster
        )


def test_one_shared_name_reaches_only_the_base_model(volume, kserve):
    """Why item 4 matters: with `--model_name=m --lora-modules m=...` (the old manifest) vLLM of
    KServe 0.15/0.16 resolves `m` to the base model, so the adapter is never used."""
    from cluster_sim import FakeVllm

    from llmft.components.lib.serving.inferenceservice import smoke_test

    server = FakeVllm(
        [
            "--model_name=m",
            "--model_dir=/mnt/models/base-models/tiny",
            "--lora-modules",
            "m=/mnt/models/models/m/trained",
        ],
        volume,
    ).start()
    try:
        with pytest.raises(RuntimeError, match="answered exactly like the base model"):
            smoke_test(server.url, "m", "What is the capital of France?", base_name="m")
    finally:
        server.stop()


def test_a_kserve_that_registers_no_lora_name_is_named(volume):
    """KServe v0.15.0 (kserve#4345) registers no --lora-modules name: the base is listed and answers, the
    adapter's name is unknown (404); the smoke test names v0.15.1, the first release that registers it."""
    from cluster_sim import FakeVllm

    from llmft.components.lib.serving.inferenceservice import smoke_test

    args = ["--model_name=m-base", "--model_dir=/mnt/models/base-models/tiny", "--lora-modules",
            "m=/mnt/models/models/m/trained"]  # fmt: skip
    server = FakeVllm(args, volume, registers_lora_names=False).start()
    try:
        with pytest.raises(RuntimeError, match=r"HTTP 404.*Model with name m does not exist.*v0\.15\.1"):
            smoke_test(server.url, "m", "What is the capital of France?", base_name="m-base", retry_wait_s=0)
    finally:
        server.stop()
    assert [r["model"] for r in server.requests] == ["m"]  # the adapter is asked first, and the step stops there


@pytest.mark.parametrize(("is_champion", "policy", "status"), [(False, "champion", "not-champion"),
                                                                (False, "always", "deployed")])  # fmt: skip
def test_only_the_champion_is_deployed_unless_forced(is_champion, policy, status, volume, tmp_path, kserve):
    """Item 5: a version that lost against the champion is registered but not deployed; the
    InferenceService keeps serving the champion. deploy_policy=always deploys it anyway."""
    cluster, custom, _ = kserve
    req = deploy_request(volume, "trained", mode="kserve", is_champion=is_champion, deploy_policy=policy)
    result = deploy_promoted(req, manifest_path=tmp_path / "isvc.yaml", cluster=cluster)
    assert result["status"] == status
    assert len(custom.created("inferenceservices")) == (status == "deployed")
    assert (tmp_path / "isvc.yaml").is_file()  # the manifest is written and validated either way


def test_kserve_mode_needs_the_base_model_on_the_volume_or_the_hub(volume, tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="outside the data volume"):
        deploy_promoted(
            deploy_request(volume, "trained", mode="kserve", base_model=str(tiny_model_dir)),
            manifest_path=tmp_path / "isvc.yaml",
        )
    hub = deploy_promoted(
        deploy_request(volume, "trained", mode="kserve", base_model="Qwen/Qwen2.5-7B-Instruct", deploy=False),
        manifest_path=tmp_path / "hub.yaml",
    )
    args = yaml.safe_load((tmp_path / "hub.yaml").read_text())["spec"]["predictor"]["model"]["args"]
    assert hub["status"] == "manifest-only" and "--model_id=Qwen/Qwen2.5-7B-Instruct" in args


def test_without_mlflow_the_promoted_adapter_is_deployed_and_the_endpoint_is_in_the_metadata(volume, tmp_path, kserve):
    """Issue 44 items 3 and 5: a run without MLflow has no champion to compare with; the promoted adapter (it beat
    the base model at the gate) is deployed under deploy_policy=champion and the result says why; the deploy
    step's output metadata carries the endpoint (nothing where nothing serves)."""
    from llmft.components.lib.serving.deployment import NO_REGISTRY_NOTE, deployment_metadata
    from llmft.components.lib.serving.inferenceservice import CHAT_ROUTE

    cluster, custom, _ = kserve
    req = deploy_request(volume, "trained", mode="kserve", registered=False, is_champion=True, deploy_policy="champion")
    result = deploy_promoted(req, manifest_path=tmp_path / "isvc.yaml", cluster=cluster)
    assert result["status"] == "deployed" and result["note"] == NO_REGISTRY_NOTE
    assert len(custom.created("inferenceservices")) == 1
    metadata = deployment_metadata(result, mode="kserve", form="lora", model="m")
    assert metadata["endpoint"] == result["url"] + CHAT_ROUTE and metadata["url"].startswith("http")
    local = deployment_metadata({"status": "checked-locally"}, mode="local", form="lora", model="m")
    assert local == {"mode": "local", "form": "lora", "status": "checked-locally", "model": "m"}
