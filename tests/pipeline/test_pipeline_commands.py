"""`llmft pipeline compile|submit|schedule` (the KFP API faked at kfp.Client) and the summary."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import yaml

from llmft.cli import main
from llmft.commands.pipeline_run import validate_cron
from llmft.components.lib.summary import render_summary
from llmft.trainer.errors import ConfigError


class FakeKfpClient:
    """Records calls at the kfp.Client boundary (no KFP server can run here). The methods and keywords are
    kfp 2.17.3's ``kfp/client/client.py``: ``create_experiment`` (443), ``create_recurring_run`` (795),
    ``create_run_from_pipeline_func`` (988). It encodes no server behaviour: the ids it returns are made up,
    and what the server does with a run (validation, scheduling, cron parsing) is not simulated;
    validate_cron's six-field rule is tested on its own."""

    instances: list[FakeKfpClient] = []

    def __init__(self, host=None, namespace="kubeflow", **_):
        self.host, self.namespace, self.calls = host, namespace, []
        FakeKfpClient.instances.append(self)

    def create_run_from_pipeline_func(self, pipeline_func, **kwargs):
        self.calls.append(("run", pipeline_func, kwargs))
        return types.SimpleNamespace(run_id="run-123")

    def create_experiment(self, name, description=None, namespace=None):
        self.calls.append(("experiment", name, namespace))
        return types.SimpleNamespace(experiment_id="exp-1")

    def create_recurring_run(self, **kwargs):
        package = Path(kwargs["pipeline_package_path"])
        spec = next(yaml.safe_load_all(package.read_text()))
        groups = [spec["root"], *(c for c in spec["components"].values() if "dag" in c)]  # exit handler, conditions
        tasks = [name for group in groups for name in group["dag"]["tasks"]]
        kwargs["package_tasks"] = sorted(t for t in tasks if not t.startswith(("exit-handler-", "condition-")))
        self.calls.append(("recurring", kwargs))
        return types.SimpleNamespace(recurring_run_id="rr-9")


@pytest.fixture
def fake_kfp(monkeypatch):
    import kfp

    FakeKfpClient.instances.clear()
    monkeypatch.setattr(kfp, "Client", FakeKfpClient)
    return FakeKfpClient.instances


@pytest.mark.slow
def test_submit_passes_typed_arguments_and_never_caches(fake_kfp, capsys):
    code = main(
        [
            "pipeline",
            "submit",
            "--host",
            "https://kfp.example.com",
            "--experiment",
            "exp",
            "--namespace",
            "team-a",
            "dataset=org/data",
            "finetune_lora_r=32",
            "serving_deploy=false",
        ]
    )
    assert code == 0 and "run-123" in capsys.readouterr().out
    (client,) = fake_kfp
    ((kind, pipeline, kwargs),) = client.calls
    assert (client.host, client.namespace, pipeline.name) == ("https://kfp.example.com", "team-a", "llm-finetune")
    assert kwargs["arguments"] == {"dataset": "org/data", "finetune_lora_r": 32, "serving_deploy": False}
    assert kwargs["experiment_name"] == "exp" and kwargs["enable_caching"] is False


@pytest.mark.slow
def test_schedule_creates_a_recurring_run_from_the_compiled_pipeline(fake_kfp):
    code = main(
        [
            "pipeline",
            "schedule",
            "--host",
            "http://kfp",
            "--cron",
            "0 30 2 * * *",
            "--name",
            "nightly",
            "finetune_max_steps=100",
        ]
    )
    assert code == 0
    experiment, (_, recurring) = fake_kfp[0].calls
    assert experiment[:2] == ("experiment", "llm-finetune")
    assert recurring["cron_expression"] == "0 30 2 * * *" and recurring["job_name"] == "nightly"
    assert recurring["experiment_id"] == "exp-1" and recurring["params"] == {"finetune_max_steps": 100}
    # a promoted run's ten steps, the not-promoted summary and the exit handler's cleanup
    assert len(recurring["package_tasks"]) == 10 + 1 + 1 and recurring["max_concurrency"] == 1


def test_five_field_cron_is_refused_with_the_six_field_fix(fake_kfp, capsys):
    code = main(["pipeline", "schedule", "--host", "http://kfp", "--cron", "30 2 * * *"])
    assert code == 1 and not fake_kfp  # refused before any client exists
    assert 'Did you mean "0 30 2 * * *"' in capsys.readouterr().err


def test_cron_validation():
    assert validate_cron(" 0  0 3 * * 1-5 ") == "0 0 3 * * 1-5"
    with pytest.raises(ConfigError, match="KFP needs six"):
        validate_cron("* * *")
    with pytest.raises(ConfigError, match="not cron syntax"):
        validate_cron("0 0 3 * * mon;rm")


def test_unknown_parameter_is_a_clear_error(capsys):
    assert main(["pipeline", "submit", "--host", "http://kfp", "lora_rank=8"]) == 1
    assert "unknown pipeline parameter `lora_rank`" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_writes_the_pipeline_with_the_given_defaults(tmp_path):
    out = tmp_path / "sub" / "p.yaml"
    assert main(["pipeline", "compile", "--output", str(out), "lora_r=32", "hf_token_secret=llmft-hf-token"]) == 0
    spec, platform = yaml.safe_load_all(out.read_text())
    assert spec["pipelineInfo"]["name"] == "llm-finetune"
    assert spec["root"]["inputDefinitions"]["parameters"]["finetune_lora_r"]["defaultValue"] == 32
    prepare = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-prepare-dataset"]
    assert [s["secretName"] for s in prepare["secretAsEnv"]] == ["llmft-hf-token"]


@pytest.mark.slow
def test_submit_mounts_the_secrets_the_run_names(fake_kfp):
    """A Secret's name is compiled in (the tasks mount it; KFP backends before 2.5 take it from no parameter):
    the run's arguments carry only run parameters, the pipeline submitted carries the name."""
    argv = ["pipeline", "submit", "--host", "http://kfp", "mlflow_secret=team-mlflow", "finetune_lora_r=8"]
    assert main(argv) == 0
    ((_, pipeline, kwargs),) = fake_kfp[0].calls
    assert kwargs["arguments"] == {"finetune_lora_r": 8}
    assert "mlflow_secret" not in pipeline.component_spec.inputs
    plan_inputs = pipeline.pipeline_spec.components["comp-exit-handler-1"].dag.tasks["plan-run"].inputs.parameters
    assert plan_inputs["mlflow_secret"].runtime_value.constant.string_value == "team-mlflow"  # compiled in: mounted


def test_submit_minimal_compiles_in_what_its_form_does_not_offer(fake_kfp):
    argv = ["pipeline", "submit", "--minimal", "--host", "http://kfp", "finetune_lora_alpha=8", "finetune_lora_r=4"]
    assert main(argv) == 0
    ((_, pipeline, kwargs),) = fake_kfp[0].calls
    assert pipeline.name == "llm-finetune-minimal" and kwargs["arguments"] == {"finetune_lora_r": 4}
    plan_inputs = pipeline.pipeline_spec.components["comp-exit-handler-1"].dag.tasks["plan-run"].inputs.parameters
    assert plan_inputs["finetune_lora_alpha"].runtime_value.constant.number_value == 8.0


def test_summary_of_a_run_whose_version_is_not_champion():
    facts = {
        "run_dir": "/w/kfp/run",
        "data": {
            "accepted": 10,
            "rejected": 0,
            "reject_reasons": {},
            "format": "messages",
            "splits": {"train": 9, "val": 1},
        },
        "evaluation": {
            "base": {"perplexity": 50.0, "eval_loss": 3.9},
            "best": "step-4",
            "checkpoints": [{"name": "step-4", "step": 4, "perplexity": 40.0, "eval_loss": 3.7}],
        },
        "registration": {
            "model_name": "m",
            "version": "7",
            "is_champion": False,
            "champion_version": "5",
            "previous_champion_version": "5",
            "alias_reason": "does not beat champion v5",
        },
        "deployment": {
            "status": "checked-locally",
            "mode": "local",
            "schema_validated": True,
            "manifest": "/w/isvc.yaml",
            "samples": [{"prompt": "p", "base": "", "adapter": "a"}],
        },
    }
    text = render_summary(facts, elapsed_s=61.2)
    assert (
        "SUCCEEDED in 61 s" in text
        and "10 rows accepted, 0 rejected; format messages" in text
        and "rejects     none" in text
    )
    assert "base 50.00 -> best 40.00 (step-4, 20.0% lower" in text
    assert "version 7; alias champion stays on v5 (not beaten)" in text
    assert "base:    (empty)" in text
