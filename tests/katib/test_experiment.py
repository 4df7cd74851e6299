"""The Experiment builder: typed models, Katib's rules, the embedded PyTorchJob, the YAML."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from katib_helpers import JOB, build_body, trial_words

from llmft.components.lib.jobs.pytorchjob_spec import pytorchjob_webhook_errors
from llmft.katib.errors import SweepError
from llmft.katib.experiment import (
    ALGORITHMS,
    FAILURE_CONDITION,
    SUCCESS_CONDITION,
    SweepSpec,
    apply_overrides,
    build_experiment,
    override_bindings,
    parse_experiment,
)
from llmft.katib.experiment_yaml import kubectl_yaml, to_yaml
from llmft.katib.metrics import METRICS_FILTER
from llmft.katib.webhook_rules import validate_experiment


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_parses_and_passes_katib_rules(bodies, algorithm, pytorchjob_schema_errors):
    body = bodies[algorithm]
    model = parse_experiment(body)  # strict: no field the katib-api models drop
    assert model.spec.algorithm.algorithm_name == algorithm
    assert validate_experiment(body) == []
    template = model.spec.trial_template
    assert template.primary_container_name == "pytorch"
    assert template.success_condition == 'status.conditions.#(type=="Succeeded")#|#(status=="True")#'
    assert template.failure_condition == 'status.conditions.#(type=="Failed")#|#(status=="True")#'
    assert template.primary_pod_labels == {"training.kubeflow.org/job-role": "master"}
    job = template.trial_spec
    assert "name" not in job.get("metadata", {}) and "namespace" not in job.get("metadata", {})
    assert pytorchjob_schema_errors(job) == []
    assert pytorchjob_webhook_errors(job) == []


def test_objective_and_collector(body):
    spec = body["spec"]
    assert spec["objective"] == {
        "type": "minimize",
        "objectiveMetricName": "eval_loss",
        "additionalMetricNames": ["perplexity"],
        "metricStrategies": [{"name": "eval_loss", "value": "min"}, {"name": "perplexity", "value": "min"}],
    }
    assert spec["metricsCollectorSpec"] == {
        "collector": {"kind": "StdOut"},
        "source": {"filter": {"metricsFormat": [METRICS_FILTER]}},
    }
    assert spec["earlyStopping"]["algorithmName"] == "medianstop"
    assert (spec["maxTrialCount"], spec["parallelTrialCount"], spec["maxFailedTrialCount"]) == (12, 3, 3)
    assert spec["resumePolicy"] == "Never"


def test_search_space_is_keyed_by_trainer_config_names(body):
    from llmft.trainer.config_load import load_config

    assert override_bindings(body) == {
        "learning_rate": "optim.lr",
        "lora_r": "lora.r",
        "lora_alpha": "lora.alpha",
        "lora_dropout": "lora.dropout",
        "warmup_ratio": "schedule.warmup_ratio",
    }
    lr = next(p for p in body["spec"]["parameters"] if p["name"] == "learning_rate")
    assert lr == {
        "name": "learning_rate",
        "parameterType": "double",
        "feasibleSpace": {"distribution": "logUniform", "min": "1e-05", "max": "0.001"},
    }
    # every bound key exists in the trainer's config and takes a value of the feasible space
    samples = {
        "optim.lr": "0.0003",
        "lora.r": "64",
        "lora.alpha": "16",
        "lora.dropout": "0.07",
        "schedule.warmup_ratio": "0.1",
    }
    cfg = load_config(None, ["model.name_or_path=m", "data=d"] + [f"{k}={v}" for k, v in samples.items()])
    assert (cfg.optim.lr, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.schedule.warmup_ratio) == (
        0.0003,
        64,
        16.0,
        0.07,
        0.1,
    )


def test_trials_reuse_the_tokenized_shards_and_get_their_own_output_dir(body):
    container = body["spec"]["trialTemplate"]["trialSpec"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"
    ][0]
    words = trial_words(container)
    assert container["command"] == ["sh", "-c"] and "llmft train --nproc" in container["args"][0]
    assert f"data={JOB['data']}" in words
    assert not any(a in ("tokenize", "llmft.trainer.data.tokenize", "prepare") for a in words)
    assert "output_dir=/data/sweeps/llmft-sweep/${trialParameters.trial_name}" in words
    trial_name = next(p for p in body["spec"]["trialTemplate"]["trialParameters"] if p["name"] == "trial_name")
    assert trial_name["reference"] == "${trialSpec.Name}"


def test_grid_uses_discrete_lists_and_counts_combinations(bodies):
    params = bodies["grid"]["spec"]["parameters"]
    assert all(p["parameterType"] == "discrete" and p["feasibleSpace"].keys() == {"list"} for p in params)
    too_many = build_body(
        "algorithm=grid",
        "space.lora_r.grid=8",
        "space.lora_alpha.grid=16",
        "space.lora_dropout.grid=0.0",
        "space.warmup_ratio.grid=0.0",
        "max_trials=5",
        "parallel_trials=2",
    )
    problems = validate_experiment(too_many)
    assert [(p.path, p.source) for p in problems] == [("spec.maxTrialCount", "suggestion")]
    assert "4 grid combinations" in problems[0].message


def test_overrides_edit_the_sweep_and_the_space():
    spec = apply_overrides(
        SweepSpec(),
        [
            "algorithm=random",
            "max_trials=20",
            "parallel_trials=4",
            "early_stopping=false",
            "space.lora_r.values=4,8",
            "space.warmup_ratio=off",
            "namespace=team-a",
        ],
    )
    assert (spec.algorithm, spec.max_trials, spec.parallel_trials, spec.early_stopping) == ("random", 20, 4, False)
    assert [p.name for p in spec.search_space] == ["learning_rate", "lora_r", "lora_alpha", "lora_dropout"]
    assert spec.search_space[1].values == ("4", "8")
    body = build_body("algorithm=random", "early_stopping=false", "space.warmup_ratio=off", "namespace=team-a")
    assert "earlyStopping" not in body["spec"] and body["metadata"]["namespace"] == "team-a"
    assert "warmup_ratio" not in override_bindings(body)


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm=hyperband", "choose one of random, tpe, grid, bayesianoptimization"),
        ("max_trials=many", "max_trials=many: expected int"),
        ("early_stopping=maybe", "expected bool"),
        ("colour=blue", "unknown sweep setting 'colour'"),
        ("space.lora_r.min=3", "min do not apply to a discrete parameter"),
        ("space.learning_rate.min=0.01", "empty range"),
        ("space.learning_rate.min=0", "logUniform range needs min > 0"),
        ("space.batch.values=1", "no searched parameter 'batch'"),
        ("space.lora_r.colour=red", "unknown field 'colour'"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(SweepError, match=message):
        apply_overrides(SweepSpec(), [override])


def test_trial_job_must_carry_every_placeholder(body):
    job = copy.deepcopy(body["spec"]["trialTemplate"]["trialSpec"])
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    script = container["args"][0]
    container["args"] = [script.replace(" lora.r=${trialParameters.lora_r}", "")]
    with pytest.raises(SweepError, match=r"lacks lora\.r=\$\{trialParameters\.lora_r\}"):
        build_experiment(SweepSpec(), job)
    container["args"] = [script.replace(" & pid=", " lora.use_dora=${trialParameters.dora} & pid=")]
    with pytest.raises(SweepError, match="unknown trial parameters"):
        build_experiment(SweepSpec(), job)
    container["name"] = "trainer"
    with pytest.raises(SweepError, match="container named 'pytorch'"):
        build_experiment(SweepSpec(), job)


def test_strict_parse_refuses_misspelt_fields(body):
    body["spec"]["trialTemplate"]["primaryContainername"] = "pytorch"
    body["spec"]["parameters"][0]["feasibleSpace"]["maximum"] = "1"
    with pytest.raises(SweepError) as err:
        parse_experiment(body)
    assert "spec.trialTemplate.primaryContainername" in str(err.value)
    assert "spec.parameters[0].feasibleSpace.maximum" in str(err.value)


def test_strict_parse_refuses_unquoted_numbers(body):
    body["spec"]["parameters"][0]["feasibleSpace"]["min"] = 1e-05  # what kubectl sends for an unquoted 1e-05
    with pytest.raises(SweepError, match="min: Input should be a valid string.*quote them"):
        parse_experiment(body)


class Yaml12Loader(yaml.SafeLoader):
    """Reads scalars the way a YAML 1.2 core-schema reader (kubectl, Go) does: 1e-05 is a float."""


Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"),
    list("-+0123456789."),
)


def test_yaml_reads_back_the_same_object_in_yaml_1_1_and_1_2(body):
    text = to_yaml(body)
    assert "min: '1e-05'" in text and "value: '42'" in text
    assert yaml.safe_load(text) == body
    assert yaml.load(text, Loader=Yaml12Loader) == body
    # the loader really is stricter: an unquoted 1e-05 becomes a float
    assert yaml.load("min: 1e-05", Loader=Yaml12Loader) == {"min": 1e-05}
    assert yaml.safe_load("min: 1e-05") == {"min": "1e-05"}


def test_every_manifest_llmft_writes_reads_back_the_same_in_yaml_1_2():
    """kubectl_yaml, the one rule render-job's job and the Experiments are written with: strings a YAML 1.2 reader
    would take for a number or bool stay strings (an env value 1e-05, an octal 0o17), key order kept."""
    manifest = {"kind": "PyTorchJob", "env": [{"name": "LR", "value": "1e-05"}, {"name": "MODE", "value": "0o17"}]}
    text = kubectl_yaml(manifest)
    assert text.startswith("kind: PyTorchJob\n") and "value: '1e-05'" in text and "value: '0o17'" in text
    assert yaml.load(text, Loader=Yaml12Loader) == manifest


def test_conditions_are_the_kubeflow_job_defaults():
    assert SUCCESS_CONDITION == 'status.conditions.#(type=="Succeeded")#|#(status=="True")#'
    assert FAILURE_CONDITION == 'status.conditions.#(type=="Failed")#|#(status=="True")#'


def test_sweep_create_takes_the_job_settings_older_names(capsys):
    """``llmft sweep create num_workers=2 model=...`` (names from before the pipeline's group prefixes) still
    builds the same trial job, with one note per renamed setting."""
    old = build_body(num_workers="2", model="org/other")  # JOB's base_model comes first: the later key wins
    new = build_body(training_workers="2", base_model="org/other")
    assert old == new
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: pipeline parameter `num_workers` is now `training_workers` (the old name still works)",
        "note: pipeline parameter `model` is now `base_model` (the old name still works)",
    ]
