"""The registered version is an MLflow Model logged from the run that trained it (issue 44 item 4): the folder the
register step writes without torch matches what mlflow.transformers.save_model writes for the same PEFT adapter,
and MLflow's own loader gives back base + adapter."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import yaml
from adapter_helpers import peft_adapter

from llmft.components.lib.registry.lineage import PARENT_TAG, PIPELINE_RUN_TAG, STEP_TAG, pipeline_parent_run
from llmft.components.lib.registry.mlflow_model import flavor_config, model_folder
from llmft.components.lib.registry.mlflow_registry import Lineage, Registration, register_adapter

pytestmark = pytest.mark.slow  # real models, MLflow's transformers flavour

VERSIONS = {"versions": {"transformers": "5.24.0", "peft": "0.21.2", "torch": "2.13.0+cpu"}}


@pytest.fixture(scope="module")
def promoted(tmp_path_factory, tiny_model_dir) -> Path:
    """A promoted copy as the promote step leaves it: adapter files plus the tokenizer it was trained with."""
    out = peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("promoted") / "adapter")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


def _outputs(model_and_tokenizer, prompt: str = "Hello there"):
    import torch

    model, tokenizer = model_and_tokenizer
    with torch.no_grad():
        return model(**tokenizer(prompt, return_tensors="pt")).logits


def _reference(tiny_model_dir: Path, promoted: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return PeftModel.from_pretrained(base, promoted).eval(), AutoTokenizer.from_pretrained(promoted)


def test_the_folder_is_what_mlflows_own_save_model_writes(tiny_model_dir, promoted, tmp_path):
    import mlflow
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), promoted)
    reference = tmp_path / "reference"
    mlflow.transformers.save_model(
        transformers_model={"model": model, "tokenizer": AutoTokenizer.from_pretrained(promoted)},
        path=str(reference),
        base_model_path=str(tiny_model_dir),
        task="text-generation",
        pip_requirements=["transformers", "peft", "torch"],
    )
    theirs = yaml.safe_load((reference / "MLmodel").read_text())["flavors"]
    with model_folder(promoted, str(tiny_model_dir), VERSIONS, model_id="m-1", run_id="r", artifact_path="a") as ours:
        mine = yaml.safe_load((ours / "MLmodel").read_text())
        files = {str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file()}
    assert set(mine["flavors"]) == set(theirs) == {"python_function", "transformers"}
    assert mine["flavors"]["python_function"]["loader_module"] == theirs["python_function"]["loader_module"]
    same = set(theirs["transformers"]) - {"transformers_version"}
    differ = {"pipeline_model_type", "tokenizer_type"}  # the Auto classes: the pipeline image has no transformers
    assert {k: mine["flavors"]["transformers"][k] for k in same - differ} == {
        k: theirs["transformers"][k] for k in same - differ
    }
    assert {k: mine["flavors"]["transformers"][k] for k in differ} == {
        "pipeline_model_type": "AutoModelForCausalLM",
        "tokenizer_type": "AutoTokenizer",
    }
    theirs_files = {str(p.relative_to(reference)) for p in reference.rglob("*") if p.is_file()}
    assert {f for f in theirs_files if f.startswith("peft/adapter_")} <= files
    assert {
        "MLmodel",
        "requirements.txt",
        "python_env.yaml",
        "conda.yaml",
        "components/tokenizer/tokenizer.json",
    } <= files
    assert mine["model_id"] == "m-1" and mine["run_id"] == "r"


def test_a_hub_base_is_referenced_by_id_and_revision(tmp_path):
    conf = flavor_config("Qwen/Qwen2.5-7B-Instruct", None, {"base_revision": "abc123", "transformers": "5"})
    assert conf["source_model_name"] == "Qwen/Qwen2.5-7B-Instruct" and conf["source_model_revision"] == "abc123"
    assert "local_base_model_path" not in conf and "torch_dtype" not in conf


def test_the_registered_version_comes_from_the_training_run_and_loads_with_mlflow(
    mlflow_server, tiny_model_dir, promoted, monkeypatch
):
    import mlflow
    import torch
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.create_experiment(f"lineage-{uuid.uuid4().hex[:8]}")
    pipeline_run = uuid.uuid4().hex[:10]
    parent = pipeline_parent_run(client, experiment, pipeline_run)
    trained = client.create_run(experiment, run_name=f"train-{pipeline_run}", tags={PARENT_TAG: parent}).info.run_id
    name = f"model-{uuid.uuid4().hex[:8]}"
    lineage = Lineage(pipeline_run, "register-model", "d" * 64, str(tiny_model_dir), checkpoint="step-4")
    registration = Registration(
        model_name=name,
        experiment=client.get_experiment(experiment).name,
        adapter_dir=promoted,
        perplexity=10.0,
        lineage=lineage,
        training_run_id=trained,
        training_manifest=VERSIONS,
    )
    facts = register_adapter(registration, client=client)

    version = client.get_model_version(name, facts["version"])
    assert version.run_id == trained == facts["model_run_id"] and version.source.startswith("models:/")
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert logged.source_run_id == trained and str(logged.status) in ("READY", "LoggedModelStatus.READY")
    register_run = client.get_run(facts["run_id"])  # the registration itself: a sibling of the training run
    assert register_run.data.tags[PARENT_TAG] == parent and register_run.data.tags[STEP_TAG] == "register"
    assert register_run.data.tags[PIPELINE_RUN_TAG] == pipeline_run
    assert not client.list_artifacts(facts["run_id"], "adapter"), "the adapter is in the model, not copied twice"
    assert facts["model_uri"] == f"models:/{name}/{facts['version']}"

    loaded = mlflow.transformers.load_model(facts["model_uri"], return_type="components")
    reference = _reference(tiny_model_dir, promoted)
    ours = (loaded["model"].eval(), loaded["tokenizer"])
    assert type(ours[0]).__name__.startswith("Peft")
    assert torch.equal(_outputs(ours), _outputs(reference))  # base + this adapter, exactly
    assert loaded["tokenizer"].chat_template == reference[1].chat_template

    again = register_adapter(registration, client=client)  # a retried register step: the same version, no new model
    assert again["version"] == facts["version"] and again["reused_existing_version"]
    assert len(client.search_logged_models([experiment]).to_list()) == 1
    assert json.loads(json.dumps(facts))  # registration.json is plain JSON
