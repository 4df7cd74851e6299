"""The plan step: every parameter checked once, one typed plan.json, a knob's whole route."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from plan_helpers import CLUSTER, RUN_ID, make_plan, parameters

from llmft.components.lib.contracts.schema import PLAN_SCHEMA_VERSION, DataLayout, RunPlan, read_plan
from llmft.components.lib.plan.build import build_plan, write_run_config
from llmft.components.lib.plan.checks import compiled_settings, parse_node_selector, parse_secret, preflight_secrets
from llmft.components.lib.plan.parameters import PipelineParameters, parameter_defaults
from llmft.components.plan import plan_run
from llmft.trainer.config_load import load_config
from llmft.trainer.errors import ConfigError, OutputNotOursError
from llmft.trainer.io import OWNED_FILE_MARK


class _RecordingParameters(PipelineParameters):
    """The typed parameters, recording which ones the builder reads."""

    def __getattribute__(self, name):
        if name in PipelineParameters.__dataclass_fields__:
            READ.add(name)
        return super().__getattribute__(name)


READ: set[str] = set()


def test_the_builder_reads_every_parameter_of_the_signature():
    """Adding a knob = the signature + the builder: a parameter nobody reads fails here."""
    READ.clear()
    values = _RecordingParameters(**parameters())
    build_plan(values, run_id=RUN_ID, compiled=compiled_settings("llm-finetune-hpo", parameters()), environ={})
    assert READ == set(parameter_defaults())


def test_plan_round_trips_through_plan_json(tmp_path):
    plan = make_plan(hpo=True, hf_token_secret="llmft-hf-token", langfuse_secret="lf", gpu_node_selector="a/b=c")
    plan_dir = tmp_path / "plan"
    from llmft.components.lib.contracts.schema import write_plan

    write_plan(plan, plan_dir)
    again = read_plan(plan_dir)
    assert again == plan and isinstance(again.job.secrets[0].keys, tuple)
    assert (
        isinstance(again.task_resources["data"].cpu, str) and again.sweep.trial_overrides == plan.sweep.trial_overrides
    )
    data = json.loads((plan_dir / "plan.json").read_text())
    data["schema_version"] = PLAN_SCHEMA_VERSION + 1
    with pytest.raises(ConfigError, match="schema version"):
        RunPlan.from_json(json.dumps(data))


def test_lora_r_reaches_the_trainer_as_an_int_through_config_yaml(tmp_path):
    """Issue 26: finetune_lora_r (pipeline) -> TrainConfig.lora.r (int, in the plan) -> config.yaml -> the trainer's
    TrainConfig.lora.r; the trainer's command line carries --config plus only what tokenize and the sweep
    decide (data=, the best values), never the plan's settings."""
    plan = make_plan(
        volume_path=str(tmp_path),
        finetune_lora_r=8,
        finetune_lora_alpha=16.0,
        finetune_learning_rate=1e-4,
        finetune_max_steps=0,
        finetune_epochs=2.0,
        finetune_overrides="save_every=50",
    )
    assert plan.trainer.config.lora.r == 8 and type(plan.trainer.config.lora.r) is int
    assert write_run_config(plan) == plan.trainer.config_path == f"{plan.trainer.run_dir}/config.yaml"
    text = Path(plan.trainer.config_path).read_text()
    assert text.startswith(OWNED_FILE_MARK) and yaml.safe_load(text)["lora"]["r"] == 8
    launch = plan.trainer.launch(f"{tmp_path}/tokenized/k")
    assert launch.overrides == {"data": f"{tmp_path}/tokenized/k"}
    cfg = load_config(launch.config_path, [f"{k}={v}" for k, v in launch.overrides.items()])
    assert (
        cfg.lora.r == 8 and type(cfg.lora.r) is int and cfg == dataclasses.replace(plan.trainer.config, data=cfg.data)
    )
    assert (cfg.lora.alpha, cfg.optim.lr, cfg.epochs, cfg.save_every) == (16.0, 1e-4, 2.0, 50)
    assert (cfg.model.name_or_path, cfg.output_dir, cfg.resume) == (
        "Qwen/Qwen2.5-7B-Instruct",
        plan.trainer.run_dir,
        "auto",
    )
    best = plan.trainer.launch("d", ["lora.r=32"])  # a sweep's best wins over the config
    assert load_config(best.config_path, [f"{k}={v}" for k, v in best.overrides.items()]).lora.r == 32
    assert make_plan(finetune_max_steps=7).trainer.config.max_steps == 7


def test_a_retried_plan_rewrites_its_config_yaml_but_never_a_foreign_one(tmp_path):
    plan = make_plan(volume_path=str(tmp_path))
    write_run_config(plan)
    first = Path(plan.trainer.config_path).read_text()
    write_run_config(plan)  # a retried plan task: same parameters, same file
    assert Path(plan.trainer.config_path).read_text() == first
    Path(plan.trainer.config_path).write_text("lora:\n  r: 64\n")  # somebody's own file
    with pytest.raises(OutputNotOursError, match="did not write"):
        write_run_config(plan)
    assert Path(plan.trainer.config_path).read_text() == "lora:\n  r: 64\n"


def test_a_bad_training_parameter_names_the_pipeline_parameter():
    with pytest.raises(ConfigError, match=r"pipeline parameter `finetune_lora_r`: `lora.r` must be > 0"):
        make_plan(finetune_lora_r=0)
    with pytest.raises(ConfigError, match=r"finetune_overrides `optim.beta1=...`: `optim.beta1` must be in"):
        make_plan(finetune_overrides="optim.beta1=2")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"training_backend": "slurm"}, "training_backend"),
        ({"serving_deploy_mode": "seldon"}, "serving_deploy_mode"),
        ({"training_workers": 0}, "training_workers"),
        ({"dataset_val_fraction": 0.0}, "dataset_val_fraction"),
        ({"promote_margin": 1.5}, "promote_margin"),
        ({"volume_pvc_name": "Data_PVC"}, "volume_pvc_name"),
        ({"serving_name": "Bad Name"}, "serving_name"),
        ({"mlflow_model_name": "../runs"}, "mlflow_model_name"),
        ({"serving_max_lora_rank": 48}, "serving_max_lora_rank"),
        ({"serving_max_lora_rank": 8, "serving_mode": "lora"}, "exceeds `serving_max_lora_rank`=8"),
        ({"finetune_learning_rate": -1.0}, "optim.lr"),
        ({"finetune_method": "prefix"}, "finetune_method"),
        ({"finetune_lora_dropout": 1.5}, "lora.dropout"),
        ({"finetune_overrides": "no_such_key=1"}, "unknown key `no_such_key`"),
        ({"finetune_overrides": "output_dir=/elsewhere"}, "set by the pipeline"),
        ({"finetune_overrides": "lora.use_dora=true", "serving_mode": "lora"}, "DoRA.*serving_mode=auto"),
        ({"serving_mode": "full"}, "serving_mode"),
        ({"base_model": " "}, "base_model"),
        ({"training_image": "registry.example.com/llmft-trainer"}, "not pinned"),
        ({"training_image": "ghcr.io/x/y:latest"}, "training_image"),
        ({"training_memory": "lots"}, "training_memory"),
        ({"step_cpu": "0"}, "step_cpu"),
        ({"gpu_node_selector": "no-equals-sign"}, "gpu_node_selector"),
        ({"hf_token_secret": "Bad_Name"}, "hf_token_secret"),
        ({"mlflow_secret": "llmft-mlflow:PASSWORD"}, "mlflow_secret"),
        ({"training_timeout_s": 3 * 24 * 3600}, "training_timeout_s"),  # the job must end before its task's timeout
        ({"serving_deploy_policy": "sometimes"}, "serving_deploy_policy"),
        ({"dataset": "http://files.internal/qa.jsonl"}, "plain http is refused"),
        ({"dataset": "https://files.example.com/qa"}, "must end in a data file name"),
        ({"dataset": "https://b.s3.amazonaws.com/qa.jsonl?X-Amz-Signature=ab"}, "`dataset`=.*presigned URL.*s3_secret"),
        ({"dataset": "s3://team-data/qa/", "dataset_config": "easy"}, "`dataset_config`='easy'.*hub dataset only"),
        ({"dataset_columns": "prompt=question"}, "`dataset_columns` 'prompt=question'.*field:column"),
        ({"dataset_columns": "prompt:q,completion:a", "dataset_format": "alpaca"}, "dataset_columns.*format is alpaca"),
        ({"s3_secret": "team-s3:AWS_PASSWORD"}, "s3_secret"),
    ],
)
def test_a_bad_parameter_is_named_before_any_work(change, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(**change)


@pytest.mark.parametrize(
    ("change", "environ", "enabled"),
    [
        ({"mlflow_tracking_uri": ""}, {}, False),  # the defaults: no server named anywhere
        ({"mlflow_tracking_uri": ""}, {"MLFLOW_TRACKING_URI": "http://here:5000"}, True),  # kfp.local: this shell's
        ({"mlflow_tracking_uri": ""}, CLUSTER, False),  # a cluster: never the task pod's environment
        ({"mlflow_tracking_uri": "", "mlflow_secret": "llmft-mlflow"}, CLUSTER, True),  # the Secret's key
        ({"mlflow_tracking_uri": "http://mlflow:5000"}, CLUSTER, True),
    ],
)
def test_mlflow_is_optional(change, environ, enabled):
    """Issue 44 item 3: with the default parameters the plan step refused ("no MLflow server") and the README never
    said a run needs one. No server configured: the run plans, registry.enabled is false."""
    assert make_plan(environ=environ, **change).registry.enabled is enabled


@pytest.mark.parametrize("uri", ["sqlite:////data/mlflow.db", "postgresql+psycopg2://db/mlflow", "mysql://db/m"])
def test_a_database_store_is_refused_on_a_cluster_and_taken_here(uri):
    """The trainer image's client (mlflow-skinny) cannot open a database store: on a cluster the evaluate step
    failed with MLflow's UnsupportedModelRegistryStoreURIException traceback (seen in make image-check); now the plan
    step refuses it in one line naming the parameter. kfp.local's tasks run in the full install, where it works."""
    with pytest.raises(ConfigError, match=r"mlflow_tracking_uri.*database store.*http\(s\) URL"):
        make_plan(environ=CLUSTER, mlflow_tracking_uri=uri)
    assert make_plan(environ={}, mlflow_tracking_uri=uri).registry.enabled


def test_full_finetuning_skips_the_lora_serving_checks():
    assert make_plan(finetune_method="full", finetune_lora_r=512, serving_max_lora_rank=8).trainer.method == "full"


@pytest.mark.parametrize(
    ("change", "note"),
    [
        ({"finetune_overrides": "lora.use_dora=true"}, "lora.use_dora=true (DoRA): vLLM does not serve DoRA"),
        ({"finetune_lora_r": 16, "serving_max_lora_rank": 8}, "`finetune_lora_r`=16 exceeds `serving_max_lora_rank`=8"),
        ({"serving_mode": "merged"}, "serving_mode=merged"),
        ({}, ""),  # a plain adapter within the rank: decided after promotion (LoRA, unless vLLM refuses it)
    ],
)
def test_what_lora_serving_refuses_is_served_merged_by_default(change, note):
    """serving_mode=auto (the default): DoRA or a rank above max_lora_rank is no error; the plan says
    the adapter will be served merged (plan_run prints it), and where the merged model goes."""
    plan = make_plan(**change)
    assert plan.serving.form_note.startswith(note) and (note == "") == (plan.serving.form_note == "")
    assert plan.serving.merged_dir == f"/data/merged/llm-adapter/{plan.run_id}"
    assert plan.serving.serving_mode == change.get("serving_mode", "auto")


def test_a_sweep_beyond_the_serving_rank_is_refused_unless_served_merged():
    """auto too: a sweep's winner must not decide whether a full merged copy is written."""
    with pytest.raises(ConfigError, match="serving_mode=merged"):
        make_plan(hpo=True, hpo_overrides="space.lora_r.values=8,16", serving_max_lora_rank=8, finetune_lora_r=8)
    plan = make_plan(hpo=True, hpo_overrides="space.lora_r.values=8,16", serving_max_lora_rank=8, finetune_lora_r=8,
                     serving_mode="merged")  # fmt: skip
    assert plan.serving.form_note == "serving_mode=merged"


@pytest.mark.parametrize(("name", "use"), [("training_backend", "pytorchjob"), ("serving_deploy_mode", "kserve")])
def test_local_backends_are_refused_on_a_cluster_and_fine_under_kfp_local(name, use):
    assert make_plan(**{name: "local"}).on_cluster is False
    with pytest.raises(ConfigError, match=f"`{name}`='local'.*kfp.local.*use {name}={use}"):
        make_plan(environ=CLUSTER, **{name: "local"})
    assert make_plan(environ=CLUSTER, **{name: use}).on_cluster is True


def test_a_local_sweep_is_refused_on_a_cluster():
    assert make_plan(hpo=True, hpo_backend="local").sweep.backend == "local"
    with pytest.raises(ConfigError, match="hpo_backend"):
        make_plan(hpo=True, hpo_backend="local", environ=CLUSTER)


def test_secret_parameters_name_the_secret_and_its_keys():
    assert parse_secret("hf", "") is None
    assert parse_secret("hf", "llmft-hf-token").keys == ("HF_TOKEN",)
    assert parse_secret("mlflow", "llmft-mlflow").keys == ("MLFLOW_TRACKING_URI",)
    auth = parse_secret("mlflow", "llmft-mlflow:MLFLOW_TRACKING_USERNAME,MLFLOW_TRACKING_PASSWORD")
    assert (auth.name, auth.keys) == ("llmft-mlflow", ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"))
    plan = make_plan(mlflow_secret="llmft-mlflow:MLFLOW_TRACKING_URI,MLFLOW_TRACKING_PASSWORD", langfuse_secret="lf")
    mounted = {s.name: s.keys for s in plan.job.secrets}
    # the mlflow_tracking_uri parameter wins over the Secret's URI key (one variable, set once)
    assert mounted == {"llmft-mlflow": ("MLFLOW_TRACKING_PASSWORD",), "lf": parse_secret("langfuse", "lf").keys}
    assert plan.job.env["MLFLOW_TRACKING_URI"] == "http://mlflow.mlflow:5000"
    assert make_plan().job.secrets == () and make_plan().task_secrets == ()
    s3 = make_plan(dataset="s3://team-data/qa/", s3_secret="team-s3:AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY,AWS_REGION")
    assert [(s.name, s.keys) for s in s3.task_secrets] == [
        ("team-s3", ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"))
    ]
    assert s3.job.secrets == ()  # the training job reads the tokenized shards, never the bucket


def test_the_data_plan_carries_the_source_its_configuration_and_columns():
    data = make_plan(dataset="acme/qa", dataset_config="hard", dataset_columns="prompt:question,completion:answer").data
    assert (data.dataset, data.config, data.columns) == ("acme/qa", "hard", "prompt:question,completion:answer")
    assert make_plan(dataset="https://files.example.com/exports/qa.csv?download=1").data.dataset.endswith("=1")


def test_node_selector_and_resources_reach_the_job_and_the_inference_service():
    assert parse_node_selector("") == {}
    labels = "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3,pool=gpu"
    plan = make_plan(gpu_node_selector=labels, training_cpu="12", training_memory="96Gi", serving_cpu="6")
    assert plan.job.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "gpu"}
    assert plan.serving.node_selector == plan.job.node_selector
    assert (plan.job.resources.cpu, plan.job.resources.memory, plan.serving.resources.cpu) == ("12", "96Gi", "6")
    assert (
        make_plan(gpu_node_selector=labels, training_gpus_per_worker=0).job.node_selector == {}
    )  # a CPU job goes anywhere


def test_hf_home_on_the_volume_wins_over_the_image(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", "/opt/image-cache")
    monkeypatch.setenv("HF_HUB_CACHE", "/opt/image-cache/hub")
    monkeypatch.setenv("TRANSFORMERS_CACHE", "/opt/image-cache/transformers")
    DataLayout(str(tmp_path)).use_hf_cache()
    import os

    assert os.environ["HF_HOME"] == f"{tmp_path}/hf-cache" and os.environ["HF_HUB_CACHE"] == f"{tmp_path}/hf-cache/hub"
    assert "TRANSFORMERS_CACHE" not in os.environ
    assert make_plan().job.env["HF_HOME"] == "/data/hf-cache"


def test_the_sweep_plan_checks_ranks_and_trial_settings():
    plan = make_plan(hpo=True, hpo_overrides="space.lora_r.values=4,8", serving_max_lora_rank=8, finetune_lora_r=8)
    assert plan.sweep.settings[-1] == "space.lora_r.values=4,8" and plan.sweep.experiment.startswith("llmft-sweep-")
    with pytest.raises(ConfigError, match="lora.r up to 64 but serving_max_lora_rank=32"):
        make_plan(hpo=True, serving_max_lora_rank=32)
    with pytest.raises(ConfigError, match=r"trial overrides \['optim.lr=0.1'\]"):
        make_plan(hpo=True, hpo_trial_overrides="optim.lr=0.1")
    assert make_plan().sweep is None  # the plain pipeline has no sweep


class _Secret:
    def __init__(self, data):
        self.data = data


class _SecretsApi:
    """CoreV1Api.read_namespaced_secret at the kubernetes-client boundary."""

    def __init__(self, secrets, status=None):
        self.secrets, self.status = secrets, status

    def read_namespaced_secret(self, name, namespace):
        from kubernetes.client.rest import ApiException

        if self.status:
            raise ApiException(status=self.status, reason="Forbidden")
        if (namespace, name) not in self.secrets:
            raise ApiException(status=404, reason="NotFound")
        return _Secret({k: "eA==" for k in self.secrets[(namespace, name)]})


def _cluster(secrets, status=None):
    from llmft.components.lib.cluster import Cluster

    return Cluster("team-a", core_api=_SecretsApi(secrets, status), custom_api=object())


def test_preflight_names_every_missing_secret_and_key():
    plan = make_plan(
        environ=CLUSTER,
        hf_token_secret="llmft-hf-token",
        mlflow_secret="llmft-mlflow:MLFLOW_TRACKING_USERNAME,MLFLOW_TRACKING_PASSWORD",
        langfuse_secret="llmft-langfuse",
    )
    present = {
        ("team-a", "llmft-hf-token"): ["HF_TOKEN"],
        ("team-a", "llmft-mlflow"): ["MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME"],
    }
    with pytest.raises(ConfigError) as error:
        preflight_secrets(plan, _cluster(present))
    message = str(error.value)
    assert "Secret team-a/llmft-langfuse does not exist" in message
    assert "Secret team-a/llmft-mlflow lacks key(s) MLFLOW_TRACKING_PASSWORD" in message
    assert "llmft-hf-token" not in message
    present[("team-a", "llmft-mlflow")].append("MLFLOW_TRACKING_PASSWORD")
    present[("team-a", "llmft-langfuse")] = ["LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_HOST"]
    assert preflight_secrets(plan, _cluster(present)) == []


def test_preflight_says_when_it_may_not_read_secrets():
    plan = make_plan(environ=CLUSTER, hf_token_secret="llmft-hf-token")
    (note,) = preflight_secrets(plan, _cluster({}, status=403))
    assert "llmft-hf-token" in note and "403" in note and "not checked" in note


def test_the_plan_component_writes_plan_json(tmp_path, monkeypatch, capsys):
    from kfp import dsl

    monkeypatch.delenv("KFP_POD_NAME", raising=False)
    artifact = dsl.Artifact(uri=str(tmp_path / "plan"))
    plan_run.python_func(
        plan=artifact,
        **parameters(finetune_lora_r=8, serving_max_lora_rank=8, volume_path=str(tmp_path), training_backend="local"),
        run_id="r1",
        compiled="",
    )
    plan = read_plan(artifact.path)
    assert plan.run_id == "r1" and plan.trainer.config.lora.r == 8 and not plan.on_cluster
    assert load_config(plan.trainer.config_path, ["data=d"]) == dataclasses.replace(plan.trainer.config, data="d")
    assert artifact.metadata["trainer_image"] == plan.images.trainer
    assert "serving form" not in capsys.readouterr().out  # a plain adapter: decided after promotion
    dora = parameters(
        finetune_lora_r=8,
        serving_max_lora_rank=8,
        finetune_overrides="lora.use_dora=true",
        volume_path=str(tmp_path),
        training_backend="local",
    )
    plan_run.python_func(plan=artifact, **dora, run_id="r2", compiled="")
    assert "serving form: merged (lora.use_dora=true (DoRA)" in capsys.readouterr().out
    assert read_plan(artifact.path).serving.form_note.startswith("lora.use_dora=true")


def test_plan_dataclasses_are_frozen():
    plan = make_plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.run_id = "other"


def test_the_plan_carries_model_revision_from_train_overrides():
    """The tokenize step tokenizes with the tokenizer revision the trainer loads (the last override wins)."""
    pinned = "b" * 40
    assert make_plan(finetune_overrides=f"model.revision=v1 model.revision={pinned}").trainer.revision == pinned
    assert make_plan().trainer.revision is None
