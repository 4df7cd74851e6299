"""The deploy step's logic: servability first, a CRD-valid manifest, then local check or KServe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from k8s_fakes import FakeCoreV1Api, FakeCustomObjectsApi
from llmft.components.lib.cluster import Cluster
from llmft.components.lib.deployment import DeployRequest, crd_schema_errors, deploy_promoted
from llmft.components.lib.servability import AdapterNotServableError
from llmft.components.lib.serving import AdapterHasNoEffectError
from llmft.trainer.errors import ConfigError


def _adapter(tiny_model_dir: Path, out: Path, *, trained: bool, dora: bool = False) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", use_dora=dora))
    if trained:  # what training does: LoRA B leaves zero
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def volume(tmp_path_factory, tiny_model_dir):
    """A stand-in for the PVC: base model and promoted adapters under one root."""
    import shutil

    root = tmp_path_factory.mktemp("volume")
    shutil.copytree(tiny_model_dir, root / "base-models" / "tiny")
    _adapter(tiny_model_dir, root / "models" / "m" / "trained", trained=True)
    _adapter(tiny_model_dir, root / "models" / "m" / "untrained", trained=False)
    _adapter(tiny_model_dir, root / "models" / "m" / "dora", trained=True, dora=True)
    return root


def request(volume: Path, adapter: str, **change) -> DeployRequest:
    fields = dict(
        adapter_dir=str(volume / "models" / "m" / adapter),
        base_model=str(volume / "base-models" / "tiny"),
        adapter_name="m",
        version="3",
        deploy=True,
        mode="local",
        name="m-serve",
        namespace="team-a",
        gpus=1,
        max_lora_rank=8,
        pvc_name="llmft-data",
        data_root=str(volume),
        timeout_s=5,
        prompts=("What is the capital of France?",),
    )
    return DeployRequest(**{**fields, **change})


def test_manifest_is_written_and_matches_the_crd(volume, tmp_path, crd_dir):
    path = tmp_path / "isvc.yaml"
    result = deploy_promoted(request(volume, "trained", deploy=False), manifest_path=path, crd_dir=str(crd_dir))
    assert result["status"] == "manifest-only" and result["schema_validated"] and result["servable"]
    isvc = yaml.safe_load(path.read_text())
    assert crd_schema_errors(isvc, crd_dir / "serving.kserve.io_inferenceservices.yaml") == []
    model = isvc["spec"]["predictor"]["model"]
    assert model["storageUri"] == "pvc://llmft-data"  # base and adapter share the volume root
    assert "m=/mnt/models/models/m/trained" in model["args"] and "--backend=vllm" in model["args"]
    assert "--model_dir=/mnt/models/base-models/tiny" in model["args"]
    assert isvc["metadata"]["labels"]["llmft/model-version"] == "3"


def test_local_mode_generates_with_and_without_the_adapter(volume, tmp_path):
    result = deploy_promoted(request(volume, "trained"), manifest_path=tmp_path / "isvc.yaml")
    assert result["status"] == "checked-locally"
    (sample,) = result["samples"]
    assert sample["prompt"] == "What is the capital of France?"
    assert isinstance(sample["base"], str) and isinstance(sample["adapter"], str)


def test_local_mode_fails_when_the_adapter_changes_nothing(volume, tmp_path):
    with pytest.raises(AdapterHasNoEffectError, match="changes nothing"):
        deploy_promoted(request(volume, "untrained"), manifest_path=tmp_path / "isvc.yaml")


def test_unservable_adapter_is_refused_before_any_manifest(volume, tmp_path):
    path = tmp_path / "isvc.yaml"
    with pytest.raises(AdapterNotServableError, match="DoRA"):
        deploy_promoted(request(volume, "dora"), manifest_path=path)
    with pytest.raises(AdapterNotServableError, match="exceeds max_lora_rank"):
        deploy_promoted(request(volume, "trained", max_lora_rank=1), manifest_path=path)
    assert not path.exists()


def test_kserve_mode_applies_waits_for_ready_and_smoke_tests(volume, tmp_path, crd_dir):
    custom = FakeCustomObjectsApi()

    def ready(obj: dict, count: int) -> None:
        obj["status"] = {
            "url": "http://m-serve.team-a.example.com",
            "address": {"url": "http://m-serve.team-a.svc"},
            "conditions": [{"type": "Ready", "status": "True"}],
            "observedGeneration": 1,
        }

    custom.on_get = ready
    posts = []

    def http_post(url, payload, timeout_s):
        posts.append((url, payload))
        return 200, {"model": payload["model"], "choices": [{"text": " Paris."}]}

    cluster = Cluster("team-a", custom_api=custom, core_api=FakeCoreV1Api())
    path = tmp_path / "isvc.yaml"
    result = deploy_promoted(
        request(volume, "trained", mode="kserve"),
        manifest_path=path,
        cluster=cluster,
        http_post=http_post,
        crd_dir=str(crd_dir),
    )
    assert result["status"] == "deployed" and result["smoke_test"]["text"] == " Paris."
    (applied,) = custom.created("inferenceservices")
    written = yaml.safe_load(path.read_text())
    assert applied["spec"] == written["spec"]  # what was validated is what was applied
    assert posts == [
        (
            "http://m-serve.team-a.svc/openai/v1/completions",
            {"model": "m", "prompt": "What is the capital of France?", "max_tokens": 16, "temperature": 0},
        )
    ]
    json.dumps(result)  # deployment.json must be serialisable


def test_kserve_mode_needs_the_base_model_on_the_volume_or_the_hub(volume, tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="outside the data volume"):
        deploy_promoted(
            request(volume, "trained", mode="kserve", base_model=str(tiny_model_dir)),
            manifest_path=tmp_path / "isvc.yaml",
        )
    hub = deploy_promoted(
        request(volume, "trained", mode="kserve", base_model="Qwen/Qwen2.5-7B-Instruct", deploy=False),
        manifest_path=tmp_path / "hub.yaml",
    )
    args = yaml.safe_load((tmp_path / "hub.yaml").read_text())["spec"]["predictor"]["model"]["args"]
    assert hub["status"] == "manifest-only" and "--model_id=Qwen/Qwen2.5-7B-Instruct" in args
