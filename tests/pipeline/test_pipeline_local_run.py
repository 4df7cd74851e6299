"""The whole pipeline through kfp.local on the tiny model (one shared run), and a bad-data run
that must stop in the prepare step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmft.components.lib.summary import render_summary
from llmft.pipelines.llm_finetune import TASK_ORDER
from llmft.pipelines.local_run import ANSI
from llmft.trainer.io import is_complete

pytestmark = pytest.mark.slow  # the whole pipeline under kfp.local (subprocesses)


def test_every_task_ran_and_left_its_artifacts(local_run):
    tasks = {p.name for p in local_run.run_dir.iterdir() if p.is_dir()}
    assert set(TASK_ORDER) <= tasks
    for key in (
        "plan",
        "data",
        "tokens",
        "training",
        "evaluation",
        "promotion",
        "serving",
        "registration",
        "deployment",
    ):
        assert key in local_run.facts, key
    plan = local_run.facts["plan"]
    assert plan["on_cluster"] is False and plan["job"]["backend"] == "local"
    # lora_r -> the plan's typed config -> <run_dir>/config.yaml -> `llmft train --config` (issue 26)
    config_path = plan["trainer"]["config_path"]
    assert plan["trainer"]["config"]["lora"]["r"] == local_run.arguments["finetune_lora_r"]
    assert yaml.safe_load(Path(config_path).read_text())["lora"]["r"] == local_run.arguments["finetune_lora_r"]
    log = ANSI.sub("", local_run.log_path.read_text())  # the exit handler's task ran after the body
    (command,) = [line for line in log.splitlines() if "training: llmft train" in line]
    assert f"--config {config_path} data=" in command and "lora.r" not in command
    assert "Executing task 'cleanup-run'" in log and "no cluster jobs to clean up" in log


def test_data_steps_report_rejects_and_shards(local_run):
    data, tokens = local_run.facts["data"], local_run.facts["tokens"]
    assert (data["accepted"], data["rejected"]) == (500, 3)  # the sample ships 3 broken rows
    assert set(data["reject_reasons"]) == {"invalid_json", "empty_assistant_content", "missing_field"}
    assert tokens["path"].startswith(local_run.arguments["volume_path"] + "/tokenized/")
    assert tokens["path"].endswith(tokens["cache_key"])
    assert tokens["splits"]["train"]["packing_efficiency"] > 0.9


def test_training_improves_on_the_base_model_and_the_best_is_promoted(local_run):
    evaluation, promotion = local_run.facts["evaluation"], local_run.facts["promotion"]
    best = next(c for c in evaluation["checkpoints"] if c["name"] == evaluation["best"])
    assert len(evaluation["checkpoints"]) >= 2
    assert best["perplexity"] < 0.9 * evaluation["base"]["perplexity"]
    assert promotion["promoted"] and promotion["checkpoint"] == best["name"]
    promoted = promotion["destination"]
    assert is_complete(promoted)
    assert json.load(open(f"{promoted}/adapter_config.json"))["r"] == local_run.arguments["finetune_lora_r"]
    assert not list(__import__("pathlib").Path(promoted).glob("optimizer*"))


def test_the_adapter_is_registered_in_the_local_mlflow_store(local_run):
    from mlflow import MlflowClient

    registration = local_run.facts["registration"]
    client = MlflowClient(tracking_uri=local_run.arguments["mlflow_tracking_uri"])
    name = local_run.arguments["mlflow_model_name"]
    champion = client.get_model_version_by_alias(name, "champion")
    assert str(champion.version) == registration["version"]
    assert champion.tags["llmft.dataset_hash"] == local_run.facts["tokens"]["cache_key"]
    assert champion.tags["llmft.base_model"] == local_run.arguments["base_model"]
    assert champion.tags["llmft.served_form"] == "lora" and "LoRA module" in champion.tags["llmft.serving_reason"]
    assert client.get_run(champion.run_id).data.params["lora.r"] == str(local_run.arguments["finetune_lora_r"])


def test_local_deploy_wrote_a_valid_manifest_and_generated(local_run):
    deployment = local_run.facts["deployment"]
    assert deployment["status"] == "checked-locally" and deployment["schema_validated"]
    assert deployment["form"] == local_run.facts["serving"]["form"] == "lora"  # a plain adapter: no merge
    assert not (__import__("pathlib").Path(local_run.arguments["volume_path"]) / "merged").exists()
    manifest = yaml.safe_load(open(local_run.facts["manifest_path"]))
    assert manifest["kind"] == "InferenceService"
    assert deployment["samples"] and all(isinstance(s["adapter"], str) for s in deployment["samples"])


def test_summary_fits_one_screen_and_names_every_fact(local_run):
    text = render_summary(local_run.facts, elapsed_s=local_run.elapsed_s)
    assert len(text.splitlines()) <= 24
    assert all(len(line) <= 100 for line in text.splitlines() if "/" not in line)  # paths may be long
    for needle in (
        "plan        run ",
        "500 rows accepted, 3 rejected",
        "perplexity  base",
        "promoted    step-",
        "serving     lora: vLLM serves the adapter as a LoRA module",
        "version 1 (models:/tiny-adapter/1);",
        "alias champion -> this version",
        "inferenceservice.yaml",
        "sample      prompt:",
    ):
        assert needle in text, needle


def test_bad_data_fails_in_the_prepare_step(tmp_path, tiny_model_dir):
    from llmft.pipelines.local_run import run_pipeline_locally

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "hi", "output": "hello"}\n' + "not json\n" * 5)
    outcome = run_pipeline_locally({"dataset": str(bad), "base_model": str(tiny_model_dir)}, work_dir=tmp_path / "work")
    assert not outcome.succeeded and outcome.failed_task == "prepare-dataset"
    assert any("rows rejected" in line for line in outcome.failure_tail), outcome.failure_tail
    assert not (outcome.run_dir / "tokenize-dataset").exists()  # nothing after prepare ran
    assert "no cluster jobs to clean up" in outcome.log_path.read_text(), "the exit handler runs after a failure too"
    assert "FAILED" in outcome.render(1.0) and "prepare-dataset" in outcome.render(1.0)


def test_a_bad_parameter_fails_in_the_plan_step_before_any_data_is_read(tmp_path, tiny_model_dir):
    from llmft.pipelines.local_run import run_pipeline_locally

    changes = {
        "base_model": str(tiny_model_dir),
        "finetune_lora_r": 64,
        "serving_mode": "lora",
    }  # auto would serve it merged
    outcome = run_pipeline_locally(changes, work_dir=tmp_path / "work")
    assert not outcome.succeeded and outcome.failed_task == "plan-run"
    assert any("exceeds `serving_max_lora_rank`=8" in line for line in outcome.failure_tail), outcome.failure_tail
    assert not (outcome.run_dir / "prepare-dataset").exists()


def test_the_train_tasks_log_carries_progress_lines_with_total_and_eta(local_run):
    """Issue 44 item 1: kfp.local's train task is no TTY: plain progress lines, no tqdm redraws."""
    log = ANSI.sub("", local_run.log_path.read_text())
    total = local_run.arguments["finetune_max_steps"]  # the parameter's name since issue 44 (was: max_steps)
    progress = [line.strip() for line in log.splitlines() if "progress: step " in line]
    assert progress and progress[-1].startswith(f"progress: step {total}/{total} (100%)"), progress[-3:]
    assert all(" ETA " in line and " elapsed " in line for line in progress)
    assert "\r" not in log.split("Executing task 'train-model'")[1].split("Executing task")[0]


def test_mlflow_holds_one_tree_per_pipeline_run_and_the_version_loads_with_mlflow(local_run):
    """Issue 44 item 4: one parent run tagged with the KFP run id; the trainer's, the evaluation's and the
    registration's runs are its children; the version comes from the training run as an MLflow Model that MLflow's
    own transformers loader turns into base + adapter."""
    import mlflow
    from mlflow import MlflowClient

    from llmft.components.lib.registry.lineage import PARENT_TAG, PIPELINE_RUN_TAG, STEP_TAG

    uri = local_run.arguments["mlflow_tracking_uri"]
    client = MlflowClient(tracking_uri=uri)
    run_id = local_run.facts["plan"]["run_id"]
    experiment = client.get_experiment_by_name(local_run.arguments["mlflow_experiment"]).experiment_id
    runs = client.search_runs([experiment], filter_string=f"tags.`{PIPELINE_RUN_TAG}` = '{run_id}'")
    by_step = {r.data.tags[STEP_TAG]: r for r in runs}
    assert sorted(by_step) == ["evaluate", "pipeline", "register", "train"] and len(runs) == 4
    parent = by_step["pipeline"].info.run_id
    assert all(by_step[s].data.tags[PARENT_TAG] == parent for s in ("train", "evaluate", "register"))
    assert (
        by_step["pipeline"].info.run_name == f"pipeline-{run_id}"
        and by_step["train"].info.run_name == f"train-{run_id}"
    )
    train = by_step["train"].data.metrics
    assert {"loss", "learning_rate", "grad_norm", "train/loss", "eval_loss", "progress_percent", "eta_seconds"} <= set(
        train
    )
    assert train["progress_percent"] == 100.0
    assert "best_perplexity" in by_step["evaluate"].data.metrics

    registration = local_run.facts["registration"]
    version = client.get_model_version(registration["model_name"], registration["version"])
    assert version.run_id == by_step["train"].info.run_id == registration["model_run_id"]
    # models:/ URIs resolve through MLflow's process-wide settings, which another test in this pytest worker may
    # have pointed at its own server (mlflow.set_tracking_uri wins over the environment): set both here; the root
    # conftest's mlflow_process_uris_restored puts them back after the test
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    loaded = mlflow.transformers.load_model(registration["model_uri"], return_type="components")
    assert type(loaded["model"]).__name__.startswith("Peft") and loaded["tokenizer"] is not None
