"""The serving form (issue 21): a DoRA adapter, which vLLM refuses as a LoRA module, ends served merged with
the reason logged: through the whole pipeline under kfp.local, and on a simulated KServe with the manifest
checked against the real InferenceService CRD."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from adapter_helpers import deploy_request, peft_adapter

from llmft.components.lib.serving.serving_form import (
    FORM_TAG,
    REASON_TAG,
    ServingForm,
    choose_form,
    prepare_serving_form,
    read_form,
    write_form,
)

LORA_FLAGS = ("--enable-lora", "--lora-modules", "--max-lora-rank")


def header_adapter(directory: Path, *, r: int = 8, dora: bool = False, **config) -> Path:
    """An adapter directory as PEFT saves it (config + safetensors with LoRA keys); the servability gate
    reads only these, so no model is needed."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.zeros(r, 4), f"{prefix}.lora_B.weight": torch.zeros(4, r)}
    if dora:
        tensors[f"{prefix}.lora_magnitude_vector"] = torch.ones(4)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"], "use_dora": dora}
    (directory / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    return directory


@pytest.mark.parametrize(
    ("adapter", "reason"),
    [
        ({"dora": True}, "use_dora=true; vLLM does not support DoRA; holds DoRA magnitude vectors"),
        ({"r": 16}, "r=16 exceeds max_lora_rank=8"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']; vLLM requires none"),
    ],
)
def test_auto_serves_merged_what_vllm_refuses_and_says_why(tmp_path, adapter, reason):
    choice = choose_form(header_adapter(tmp_path / "a", **adapter), "auto", max_lora_rank=8)
    assert choice.form == "merged" and choice.problems
    assert choice.reason == f"vLLM cannot serve the adapter as a LoRA module: {reason}"


def test_a_servable_adapter_is_served_as_lora_and_nothing_is_merged(tmp_path, capsys):
    adapter = header_adapter(tmp_path / "a")
    form = prepare_serving_form(adapter, serving_mode="auto", max_lora_rank=8, merged_dir=tmp_path / "merged")
    assert (form.form, form.model_dir, form.problems, form.export_manifest) == ("lora", str(adapter), (), None)
    assert not (tmp_path / "merged").exists()
    assert "serving form: lora (vLLM serves the adapter as a LoRA module (max LoRA rank 8))" in capsys.readouterr().out


def test_lora_mode_refuses_what_vllm_refuses_and_names_the_way_out(tmp_path):
    from llmft.components.lib.serving.servability import AdapterNotServableError

    with pytest.raises(AdapterNotServableError, match=r"(?s)use_dora=true.*serving_mode=auto \(or merged\)"):
        choose_form(header_adapter(tmp_path / "a", dora=True), "lora", max_lora_rank=8)
    assert choose_form(header_adapter(tmp_path / "b"), "merged", max_lora_rank=8).reason == "serving_mode=merged"


def test_a_full_finetune_has_no_adapter_to_serve_as_lora_or_merge(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_bytes(b"")
    assert choose_form(tmp_path / "full", "auto", max_lora_rank=8).form == "full"


def test_serving_json_round_trips_and_gives_the_mlflow_tags(tmp_path):
    form = ServingForm("merged", "auto", "r" * 6000, "/data/models/m/r", "/data/merged/m/r", ("p",), {"dtype": "x"})
    write_form(form, tmp_path)
    assert read_form(tmp_path) == form
    assert json.loads((tmp_path / "export_manifest.json").read_text()) == {"dtype": "x"}
    tags = form.tags()
    assert tags[FORM_TAG] == "merged" and len(tags[REASON_TAG]) == 5000  # MLflow's tag value limit
    assert tags["llmft.served_model_dir"] == "/data/merged/m/r" and tags["llmft.serving_mode"] == "auto"


# ----------------------------------------------------------------------------- real adapters: merge and serve


@pytest.fixture(scope="module")
def volume(tmp_path_factory, tiny_model_dir):
    """The PVC stand-in: the base model and promoted adapters under one root (adapters name the base there)."""
    root = tmp_path_factory.mktemp("volume")
    base = Path(shutil.copytree(tiny_model_dir, root / "base-models" / "tiny"))
    peft_adapter(base, root / "models" / "m" / "dora", dora=True)
    peft_adapter(base, root / "models" / "m" / "untrained", dora=False, trained=False)
    return root


@pytest.mark.slow
def test_a_dora_adapter_is_merged_once_and_a_retry_reuses_the_merge(volume, tmp_path):
    from llmft.trainer.errors import OutputNotOursError
    from llmft.trainer.io import OWNER_FILE, is_complete

    adapter, merged = volume / "models" / "m" / "dora", tmp_path / "merged" / "m" / "run-1"
    form = prepare_serving_form(adapter, serving_mode="auto", max_lora_rank=8, merged_dir=merged)
    assert form.form == "merged" and "DoRA" in form.reason and form.model_dir == str(merged) and not form.reused
    assert is_complete(merged) and form.export_manifest["adapter"]["use_dora"] is True
    assert form.export_manifest["dtype"] == "bfloat16" and "quantization_config" not in json.loads(
        (merged / "config.json").read_text()
    )
    written = {p.name: p.stat().st_mtime_ns for p in merged.glob("*.safetensors")}
    retry = prepare_serving_form(adapter, serving_mode="auto", max_lora_rank=8, merged_dir=merged)
    assert retry.reused and retry.export_manifest == form.export_manifest
    assert {p.name: p.stat().st_mtime_ns for p in merged.glob("*.safetensors")} == written  # not merged again

    foreign = tmp_path / "merged" / "m" / "run-2"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone's files")
    with pytest.raises(OutputNotOursError, match=rf"serving form merged \(vLLM cannot serve .*\): {foreign}"):
        prepare_serving_form(adapter, serving_mode="auto", max_lora_rank=8, merged_dir=foreign)
    assert (foreign / "notes.txt").read_text() == "someone's files" and not (foreign / OWNER_FILE).exists()


def form_request(volume: Path, adapter: str, form: ServingForm, **change):
    """The deploy request of ``form`` (the choose-serving-form step's output), on a KServe cluster."""
    fields = dict(version="4", mode="kserve", form=form.form, model_dir=form.model_dir, form_reason=form.reason)
    return deploy_request(volume, adapter, **{**fields, **change})


@pytest.mark.slow
def test_kserve_serves_the_merged_dora_model_alone_and_the_smoke_test_reaches_it(volume, tmp_path, crd_dir):
    """The InferenceService of the merged form: storage = the merged directory, one served name, no LoRA
    flag; CRD-valid; the simulated KServe (tests/k8s/cluster_sim.py) serves it and the smoke test asks it."""
    from cluster_sim import ClusterSim
    from k8s_fakes import FakeCoreV1Api, FakeCustomObjectsApi

    from llmft.components.lib.cluster import Cluster
    from llmft.components.lib.serving.deployment import crd_schema_errors, deploy_promoted

    merged = volume / "merged" / "m" / "run-1"
    form = prepare_serving_form(volume / "models" / "m" / "dora", serving_mode="auto", max_lora_rank=8,
                                merged_dir=merged)  # fmt: skip
    custom, core = FakeCustomObjectsApi(), FakeCoreV1Api()
    sim = ClusterSim(custom, core, "team-a", tmp_path / "pods", volumes={"llmft-data": volume})
    try:
        result = deploy_promoted(
            form_request(volume, "dora", form),
            manifest_path=tmp_path / "isvc.yaml",
            cluster=Cluster("team-a", custom_api=custom, core_api=core),
            crd_dir=str(crd_dir),
        )
        (server,) = sim.servers.values()
    finally:
        sim.stop()
    assert result["status"] == "deployed" and result["form"] == "merged" and result["schema_validated"]
    assert result["served_models"] == ["m"] and result["base_name"] is None
    manifest = yaml.safe_load((tmp_path / "isvc.yaml").read_text())
    assert crd_schema_errors(manifest, crd_dir / "serving.kserve.io_inferenceservices.yaml") == []
    (applied,) = custom.created("inferenceservices")
    assert applied["spec"] == manifest["spec"] and applied["metadata"]["labels"]["llmft/served-form"] == "merged"
    model = applied["spec"]["predictor"]["model"]
    assert model["storageUri"] == "pvc://llmft-data/merged/m/run-1"
    assert "--model_name=m" in model["args"] and "--model_dir=/mnt/models" in model["args"]
    assert not [a for a in model["args"] if a.startswith(LORA_FLAGS)]
    assert server.base_dir == merged and server.loras == {}  # vLLM loads the merged directory itself
    assert result["smoke_test"]["models"] == ["m"] and [r["model"] for r in server.requests] == ["m"]


@pytest.mark.slow
def test_the_local_check_loads_the_merged_model_and_refuses_one_that_changes_nothing(volume, tmp_path):
    """serving_deploy_mode=local in the merged form: the merged directory against the base rounded to its dtype, so
    an untrained adapter (B = 0) merges into exactly the base's bf16 weights and is caught."""
    from llmft.components.lib.serving.deployment import deploy_promoted
    from llmft.components.lib.serving.local_check import AdapterHasNoEffectError

    dora = prepare_serving_form(volume / "models" / "m" / "dora", serving_mode="auto", max_lora_rank=8,
                                merged_dir=volume / "merged" / "m" / "local-dora")  # fmt: skip
    result = deploy_promoted(form_request(volume, "dora", dora, mode="local"), manifest_path=tmp_path / "a.yaml")
    assert result["status"] == "checked-locally" and result["form"] == "merged"
    assert isinstance(result["samples"][0]["adapter"], str)
    zero = prepare_serving_form(volume / "models" / "m" / "untrained", serving_mode="merged", max_lora_rank=8,
                                merged_dir=volume / "merged" / "m" / "local-zero")  # fmt: skip
    with pytest.raises(AdapterHasNoEffectError, match="changes nothing"):
        deploy_promoted(form_request(volume, "untrained", zero, mode="local"), manifest_path=tmp_path / "b.yaml")


# ----------------------------------------------------------------------------- the whole pipeline (kfp.local)


@pytest.fixture(scope="module")
def dora_run(tmp_path_factory):
    """The pipeline under kfp.local with a DoRA adapter (finetune_overrides lora.use_dora=true), serving_mode auto."""
    from llmft.pipelines.defaults import LOCAL_DEFAULTS
    from llmft.pipelines.local_run import run_pipeline_locally

    overrides = {
        "finetune_overrides": LOCAL_DEFAULTS["finetune_overrides"] + " lora.use_dora=true",
        "finetune_max_steps": 32,
    }
    outcome = run_pipeline_locally(overrides, work_dir=tmp_path_factory.mktemp("pipeline-dora"))
    if not outcome.succeeded:
        pytest.fail(outcome.render(0.0) + "\n" + outcome.log_path.read_text()[-6000:])
    return outcome


@pytest.mark.slow
def test_a_dora_run_is_served_merged_through_the_pipeline_with_the_reason_logged(dora_run):
    from llmft.components.lib.summary import render_summary
    from llmft.pipelines.local_run import ANSI

    facts, arguments = dora_run.facts, dora_run.arguments
    log = ANSI.sub("", dora_run.log_path.read_text())
    assert "serving form: merged (lora.use_dora=true (DoRA): vLLM does not serve DoRA adapters" in log  # the plan
    assert "serving form: merged (vLLM cannot serve the adapter as a LoRA module: use_dora=true" in log
    promoted = Path(facts["promotion"]["destination"])
    assert json.loads((promoted / "adapter_config.json").read_text())["use_dora"] is True  # promote let it through
    serving = facts["serving"]
    merged = Path(arguments["volume_path"]) / "merged" / arguments["mlflow_model_name"] / facts["plan"]["run_id"]
    assert serving["form"] == "merged" and serving["model_dir"] == str(merged) and serving["requested"] == "auto"
    assert serving["export_manifest"]["adapter"]["sha256"] == _sha256(promoted / "adapter_model.safetensors")
    assert (merged / "COMPLETE").is_file() and (merged / "tokenizer_config.json").is_file()

    deployment = facts["deployment"]
    assert deployment["status"] == "checked-locally" and deployment["form"] == "merged"
    assert deployment["schema_validated"] and deployment["served_models"] == [arguments["mlflow_model_name"]]
    manifest = yaml.safe_load(open(facts["manifest_path"]))
    args = manifest["spec"]["predictor"]["model"]["args"]
    assert manifest["metadata"]["labels"]["llmft/served-form"] == "merged"
    assert not [a for a in args if a.startswith(LORA_FLAGS)]
    assert manifest["spec"]["predictor"]["model"]["storageUri"].endswith(f"/merged/tiny-adapter/{merged.name}")
    assert "serving     merged: vLLM cannot serve the adapter" in render_summary(facts)


@pytest.mark.slow
def test_the_mlflow_version_records_the_merged_form_and_the_export_manifest(dora_run):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=dora_run.arguments["mlflow_tracking_uri"])
    registration = dora_run.facts["registration"]
    version = client.get_model_version(registration["model_name"], registration["version"])
    assert version.tags[FORM_TAG] == "merged" and registration["served_form"] == "merged"
    assert "use_dora=true; vLLM does not support DoRA" in version.tags[REASON_TAG]
    assert version.tags["llmft.served_model_dir"] == dora_run.facts["serving"]["model_dir"]
    root = {a.path for a in client.list_artifacts(registration["run_id"])}
    assert {"serving.json", "export_manifest.json"} <= root
    logged = json.loads(Path(client.download_artifacts(registration["run_id"], "export_manifest.json")).read_text())
    assert logged == dora_run.facts["serving"]["export_manifest"]
    assert not [p for p in root if p.endswith(".safetensors")]  # the merged weights stay on the volume
    assert version.source.startswith("models:/")  # the adapter itself: the MLflow Model of its training run


def _sha256(path: Path) -> str:
    from llmft.trainer.io import sha256_file

    return sha256_file(path)
