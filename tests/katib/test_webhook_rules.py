"""Katib's admission rules, encoded: each rule rejects the Experiment it is about, and only that."""

from __future__ import annotations

import pytest

from llmft.katib.errors import SweepError
from llmft.katib.webhook_rules import check_experiment, validate_experiment


def _set(path: str, value):
    """A mutation setting ``path`` (dots, [i] for list items) to ``value``; None deletes the key."""

    def mutate(body: dict) -> None:
        node = body
        parts = path.replace("]", "").replace("[", ".").split(".")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node[part]
        last = parts[-1]
        if value is None:
            del node[int(last) if last.isdigit() else last]
        else:
            node[int(last) if last.isdigit() else last] = value

    return mutate


TEMPLATE = "spec.trialTemplate"
CONTAINER = f"{TEMPLATE}.trialSpec.spec.pytorchReplicaSpecs.Master.template.spec.containers[0]"


def _replace_arg(old_prefix: str, new: str | None):
    def mutate(body: dict) -> None:
        container = body["spec"]["trialTemplate"]["trialSpec"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"][
            "spec"
        ]["containers"][0]
        words = [w for w in container["args"][0].split(" ") if not w.startswith(old_prefix)]  # the sh -c script
        if new:
            words.insert(words.index("&"), new)  # last word of the trainer's command line
        container["args"] = [" ".join(words)]

    return mutate


CASES = {
    # name
    "name with upper case": (_set("metadata.name", "LLM-sweep"), "metadata.name", "webhook"),
    "name ending with dash": (_set("metadata.name", "llmft-"), "metadata.name", "webhook"),
    "name over 40 chars": (_set("metadata.name", "a" * 41), "metadata.name", "webhook"),
    # counts
    "parallel > max": (_set("spec.parallelTrialCount", 13), "spec.parallelTrialCount", "webhook"),
    "max failed > max": (_set("spec.maxFailedTrialCount", 13), "spec.maxFailedTrialCount", "webhook"),
    "max failed negative": (_set("spec.maxFailedTrialCount", -1), "spec.maxFailedTrialCount", "webhook"),
    "max trials zero": (_set("spec.maxTrialCount", 0), "spec.maxTrialCount", "webhook"),
    "parallel zero": (_set("spec.parallelTrialCount", 0), "spec.parallelTrialCount", "webhook"),
    # objective
    "no objective": (_set("spec.objective", None), "spec.objective", "webhook"),
    "objective type": (_set("spec.objective.type", "lower"), "spec.objective.type", "webhook"),
    "no objective metric": (
        _set("spec.objective.objectiveMetricName", ""),
        "spec.objective.objectiveMetricName",
        "webhook",
    ),
    "objective repeated": (
        _set("spec.objective.additionalMetricNames", ["eval_loss"]),
        "spec.objective.additionalMetricNames",
        "webhook",
    ),
    "metric strategy": (
        _set("spec.objective.metricStrategies[0].value", "median"),
        "spec.objective.metricStrategies[0].value",
        "project",
    ),
    # algorithm and early stopping
    "no algorithm": (_set("spec.algorithm", None), "spec.algorithm", "webhook"),
    "unknown algorithm": (_set("spec.algorithm.algorithmName", "annealing"), "spec.algorithm.algorithmName", "webhook"),
    "optuna setting for hyperopt tpe": (
        _set("spec.algorithm.algorithmSettings[0].name", "n_startup_trials"),
        "spec.algorithm.algorithmSettings[0]",
        "suggestion",
    ),
    "tpe gamma out of range": (
        _set("spec.algorithm.algorithmSettings", [{"name": "gamma", "value": "1.5"}]),
        "spec.algorithm.algorithmSettings[0]",
        "suggestion",
    ),
    "negative seed": (
        _set("spec.algorithm.algorithmSettings[0].value", "-1"),
        "spec.algorithm.algorithmSettings[0]",
        "suggestion",
    ),
    "unknown early stopping": (
        _set("spec.earlyStopping.algorithmName", "asha"),
        "spec.earlyStopping.algorithmName",
        "webhook",
    ),
    "medianstop start_step 0": (
        _set("spec.earlyStopping.algorithmSettings[1].value", "0"),
        "spec.earlyStopping.algorithmSettings[1]",
        "earlystopping",
    ),
    "resume policy": (_set("spec.resumePolicy", "Always"), "spec.resumePolicy", "webhook"),
    # parameters
    "no parameters": (_set("spec.parameters", []), "spec", "webhook"),
    "parameter type": (
        _set("spec.parameters[0].parameterType", "float"),
        "spec.parameters[0].parameterType",
        "webhook",
    ),
    "distribution": (
        _set("spec.parameters[0].feasibleSpace.distribution", "exponential"),
        "spec.parameters[0].feasibleSpace.distribution",
        "webhook",
    ),
    "empty feasible space": (
        _set("spec.parameters[0].feasibleSpace", {}),
        "spec.parameters[0].feasibleSpace",
        "webhook",
    ),
    "double without max": (
        _set("spec.parameters[0].feasibleSpace.max", None),
        "spec.parameters[0].feasibleSpace.max",
        "webhook",
    ),
    "double with list": (
        _set("spec.parameters[0].feasibleSpace.list", ["0.1"]),
        "spec.parameters[0].feasibleSpace.list",
        "webhook",
    ),
    "empty range": (
        _set("spec.parameters[0].feasibleSpace.min", "0.01"),
        "spec.parameters[0].feasibleSpace",
        "project",
    ),
    "log range from zero": (
        _set("spec.parameters[0].feasibleSpace.min", "0"),
        "spec.parameters[0].feasibleSpace.min",
        "project",
    ),
    "discrete with min": (
        _set("spec.parameters[1].feasibleSpace.min", "8"),
        "spec.parameters[1].feasibleSpace",
        "webhook",
    ),
    "discrete empty list": (
        _set("spec.parameters[1].feasibleSpace.list", []),
        "spec.parameters[1].feasibleSpace",
        "webhook",
    ),
    # trial template
    "no trial template": (_set(TEMPLATE, None), TEMPLATE, "webhook"),
    "no primary container": (
        _set(f"{TEMPLATE}.primaryContainerName", ""),
        f"{TEMPLATE}.primaryContainerName",
        "webhook",
    ),
    "primary container not pytorch": (
        _set(f"{TEMPLATE}.primaryContainerName", "main"),
        f"{TEMPLATE}.primaryContainerName",
        "project",
    ),
    "no success condition": (_set(f"{TEMPLATE}.successCondition", None), TEMPLATE, "webhook"),
    "batch job failure condition": (
        _set(f"{TEMPLATE}.failureCondition", 'status.conditions.#(type=="Failed")#'),
        TEMPLATE,
        "project",
    ),
    "no trial parameters": (_set(f"{TEMPLATE}.trialParameters", None), f"{TEMPLATE}.trialParameters", "webhook"),
    "reference not searched": (
        _set(f"{TEMPLATE}.trialParameters[0].reference", "lr"),
        f"{TEMPLATE}.trialParameters[0].reference",
        "webhook",
    ),
    "duplicate trial parameter": (
        _set(f"{TEMPLATE}.trialParameters[1].name", "learning_rate"),
        f"{TEMPLATE}.trialParameters[1].name",
        "webhook",
    ),
    "duplicate reference": (
        _set(f"{TEMPLATE}.trialParameters[1].reference", "learning_rate"),
        f"{TEMPLATE}.trialParameters[1].reference",
        "webhook",
    ),
    "brace in name": (_set(f"{TEMPLATE}.trialParameters[0].name", "lr}"), f"{TEMPLATE}.trialParameters[0]", "webhook"),
    "trial parameter unused": (
        _replace_arg("optim.lr=", "optim.lr=0.001"),
        f"{TEMPLATE}.trialParameters[0].name",
        "webhook",
    ),
    "placeholder not declared": (
        _replace_arg("seed=", "seed=${trialParameters.seed}"),
        f"{TEMPLATE}.trialSpec",
        "webhook",
    ),
    "trial spec with name": (
        _set(f"{TEMPLATE}.trialSpec.metadata.name", "job"),
        f"{TEMPLATE}.trialSpec.metadata",
        "webhook",
    ),
    "trial spec with namespace": (
        _set(f"{TEMPLATE}.trialSpec.metadata.namespace", "ns"),
        f"{TEMPLATE}.trialSpec.metadata",
        "webhook",
    ),
    "trial spec without kind": (_set(f"{TEMPLATE}.trialSpec.kind", None), f"{TEMPLATE}.trialSpec", "webhook"),
    "trial spec and config map": (_set(f"{TEMPLATE}.configMap", {"configMapName": "x"}), TEMPLATE, "webhook"),
    "container renamed": (
        _set(f"{CONTAINER}.name", "trainer"),
        f"{TEMPLATE}.trialSpec.spec.pytorchReplicaSpecs.Master",
        "project",
    ),
    # metrics collector
    "collector kind": (
        _set("spec.metricsCollectorSpec.collector.kind", "Stdout"),
        "spec.metricsCollectorSpec.collector.kind",
        "webhook",
    ),
    "filter one group": (
        _set("spec.metricsCollectorSpec.source.filter.metricsFormat", [r"eval_loss=([0-9.]+)"]),
        "spec.metricsCollectorSpec.source.filter.metricsFormat[0]",
        "project",
    ),
    "filter does not compile": (
        _set("spec.metricsCollectorSpec.source.filter.metricsFormat", ["(a)(b"]),
        "spec.metricsCollectorSpec.source.filter.metricsFormat[0]",
        "project",
    ),
    "filter lookahead": (
        _set("spec.metricsCollectorSpec.source.filter.metricsFormat", [r"(\w+)(?==)=(\d+)"]),
        "spec.metricsCollectorSpec.source.filter.metricsFormat[0]",
        "project",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rule_rejects_its_case(body, case):
    mutate, path, source = CASES[case]
    assert validate_experiment(body) == []
    mutate(body)
    problems = validate_experiment(body)
    assert problems, f"{case}: accepted"
    assert any(p.path == path and p.source == source for p in problems), [str(p) for p in problems]
    with pytest.raises(SweepError, match="Katib would reject"):
        check_experiment(body)


def test_all_violations_are_reported_together(body):
    _set("spec.parallelTrialCount", 20)(body)
    _set("metadata.name", "Bad")(body)
    _set(f"{TEMPLATE}.trialSpec.metadata.name", "job")(body)
    paths = {p.path for p in validate_experiment(body)}
    assert {"spec.parallelTrialCount", "metadata.name", f"{TEMPLATE}.trialSpec.metadata"} <= paths


def test_meta_references_are_not_search_parameters(body):
    params = body["spec"]["trialTemplate"]["trialParameters"]
    assert any(p["reference"] == "${trialSpec.Name}" for p in params)
    params.append({"name": "owner", "reference": "${trialSpec.Labels[owner]}"})
    _replace_arg("observe.run_name=", "observe.run_name=${trialParameters.owner}")(body)
    assert validate_experiment(body) == []
