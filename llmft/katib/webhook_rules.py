"""Katib's admission rules for an Experiment, encoded so that they run here.

The Experiment CRD is schema-less (``x-kubernetes-preserve-unknown-fields``):
the API server accepts any object and Katib's validating webhook decides. No
cluster runs here, so :func:`validate_experiment` re-implements the webhook's
checks (``pkg/webhook/v1beta1/experiment/validator/validator.go`` at v0.19.0,
ErrorList form: every problem is reported, not only the first) and adds the
checks the suggestion and early-stopping services run when they start
(``ValidateAlgorithmSettings`` / ``ValidateEarlyStoppingSettings``), plus a few
project rules for PyTorchJob and TrainJob trials. Each violation names its source:

- ``webhook``: rejected by the API server at create time;
- ``suggestion`` / ``earlystopping``: the Experiment is admitted but fails when
  the service starts (a late failure, worse than an early one);
- ``project``: would run, but wrongly (no metrics, or a PyTorchJob Katib never
  sees finish).

The code paths are written from the Go source; nothing is copied.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmft.katib.errors import SweepError
from llmft.katib.k8s_names import RFC1035_LABEL
from llmft.katib.trial_kinds import TRAINJOB, TRIAL_KINDS

# Katib's default katib-config (v0.19) suggestion and early-stopping services.
KNOWN_ALGORITHMS = (
    "random",
    "tpe",
    "multivariate-tpe",
    "grid",
    "hyperband",
    "bayesianoptimization",
    "cmaes",
    "sobol",
    "enas",
    "darts",
    "pbt",
)
KNOWN_EARLY_STOPPING = ("medianstop",)
RESUME_POLICIES = ("", "Never", "LongRunning", "FromVolume")
PARAMETER_TYPES = ("int", "double", "categorical", "discrete", "")
DISTRIBUTIONS = ("", "uniform", "logUniform", "normal", "logNormal")
COLLECTOR_KINDS = ("StdOut", "File", "TensorFlowEvent", "PrometheusMetric", "Custom", "Push")
METRIC_STRATEGIES = ("min", "max", "latest")
TRIAL_META_KEYS = ("Name", "Namespace", "Kind", "APIVersion", "Labels", "Annotations")

NAME_RE = RFC1035_LABEL  # the one Kubernetes-name validator (llmft/katib/k8s_names.py)
NAME_MAX = 40  # platform-facts.md: the suggestion's deployment/service names are derived from it
PARAM_FORMAT = "${trialParameters.%s}"
PARAM_RE = re.compile(r"\$\{trialParameters\..+?\}")
META_RE = re.compile(r"\$\{trialSpec\.(.+?)\}")
META_INDEX_RE = re.compile(r"(.+)\[(.+)]")
TWO_GROUPS_RE = re.compile(r".*\(.*\).*\(.*\).*")

KUBEFLOW_SUCCESS = 'status.conditions.#(type=="Succeeded")#|#(status=="True")#'
KUBEFLOW_FAILURE = 'status.conditions.#(type=="Failed")#|#(status=="True")#'

# Which service answers each algorithm in Katib 0.19's default katib-config
# (manifests/v1beta1/installs/katib-standalone/katib-config.yaml), and the settings each
# service's ValidateAlgorithmSettings accepts, with a check per value.
SUGGESTION_SERVICES = {
    "random": "hyperopt",
    "tpe": "hyperopt",
    "grid": "optuna",
    "multivariate-tpe": "optuna",
    "bayesianoptimization": "skopt",
    "cmaes": "goptuna",
    "sobol": "goptuna",
    "hyperband": "hyperband",
    "enas": "enas",
    "darts": "darts",
    "pbt": "pbt",
}
_NON_NEG_INT = ("a non-negative integer", lambda v: int(v) >= 0)
_POS_INT = ("a positive integer", lambda v: int(v) > 0)
ALGORITHM_SETTINGS: dict[str, dict[str, tuple]] = {
    "random": {"random_state": _NON_NEG_INT},
    "tpe": {
        "gamma": ("a number in (0, 1)", lambda v: 0 < float(v) < 1),
        "prior_weight": ("a number > 0", lambda v: float(v) > 0),
        "n_EI_candidates": _POS_INT,
        "random_state": _NON_NEG_INT,
    },
    "grid": {"random_state": _NON_NEG_INT},
    "multivariate-tpe": {k: _NON_NEG_INT for k in ("n_startup_trials", "n_ei_candidates", "random_state")},
    "bayesianoptimization": {
        "base_estimator": ("one of GP, RF, ET, GBRT", lambda v: v in ("GP", "RF", "ET", "GBRT")),
        "n_initial_points": _NON_NEG_INT,
        "acq_func": (
            "one of gp_hedge, LCB, EI, PI, EIps, PIps",
            lambda v: v in ("gp_hedge", "LCB", "EI", "PI", "EIps", "PIps"),
        ),
        "acq_optimizer": ("one of auto, sampling, lbfgs", lambda v: v in ("auto", "sampling", "lbfgs")),
        "random_state": _NON_NEG_INT,
    },
}
MEDIANSTOP_SETTINGS = {
    "min_trials_required": ("an integer > 0", lambda v: int(v) > 0),
    "start_step": ("an integer >= 1", lambda v: int(v) >= 1),
}


@dataclass(frozen=True)
class Violation:
    """One broken rule: where, what, and which component would reject it."""

    path: str
    """JSON path in the Experiment, e.g. spec.parallelTrialCount."""
    message: str
    """What is wrong and how to fix it."""
    source: str
    """webhook, suggestion, earlystopping or project."""

    def __str__(self) -> str:
        return f"{self.path}: {self.message} [{self.source}]"


def validate_experiment(body: Mapping[str, Any]) -> list[Violation]:
    """Every rule the Experiment breaks (empty list: Katib would admit and run it)."""
    spec = body.get("spec") or {}
    out: list[Violation] = []
    out += _check_name((body.get("metadata") or {}).get("name") or "")
    out += _check_counts(spec)
    objective = _check_objective(spec.get("objective"))
    if objective:  # the webhook stops at a bad objective
        return out + objective
    out += _check_algorithm(spec)
    out += _check_early_stopping(spec.get("earlyStopping"))
    if spec.get("resumePolicy", "") not in RESUME_POLICIES:
        out.append(
            Violation(
                "spec.resumePolicy",
                f"invalid ResumePolicyType {spec.get('resumePolicy')!r}; use Never, LongRunning or FromVolume",
                "webhook",
            )
        )
    out += _check_trial_template(spec)
    out += _check_parameters(spec)
    out += _check_metrics_collector(spec.get("metricsCollectorSpec") or {})
    return out


def check_experiment(body: Mapping[str, Any]) -> None:
    """Raise :class:`SweepError` listing every violation."""
    problems = validate_experiment(body)
    if problems:
        raise SweepError("Katib would reject this Experiment:\n  " + "\n  ".join(map(str, problems)))


def _check_name(name: str) -> list[Violation]:
    out = []
    if not NAME_RE.match(name):
        out.append(
            Violation(
                "metadata.name",
                f"{name!r} must consist of lower case alphanumerics or '-', start "
                "with a letter and end with an alphanumeric",
                "webhook",
            )
        )
    if len(name) > NAME_MAX:
        out.append(Violation("metadata.name", f"{name!r} is {len(name)} characters; at most {NAME_MAX}", "webhook"))
    return out


def _check_counts(spec: Mapping[str, Any]) -> list[Violation]:
    out = []
    max_t, par, fail = (spec.get(k) for k in ("maxTrialCount", "parallelTrialCount", "maxFailedTrialCount"))
    if fail is not None and fail < 0:
        out.append(Violation("spec.maxFailedTrialCount", "should not be less than 0", "webhook"))
    if max_t is not None and max_t <= 0:
        out.append(Violation("spec.maxTrialCount", "must be greater than 0", "webhook"))
    if par is not None and par <= 0:
        out.append(Violation("spec.parallelTrialCount", "must be greater than 0", "webhook"))
    if fail is not None and max_t is not None and fail > max_t:
        out.append(Violation("spec.maxFailedTrialCount", f"{fail} should be <= spec.maxTrialCount {max_t}", "webhook"))
    if par is not None and max_t is not None and par > max_t:
        out.append(Violation("spec.parallelTrialCount", f"{par} should be <= spec.maxTrialCount {max_t}", "webhook"))
    return out


def _check_objective(obj: Mapping[str, Any] | None) -> list[Violation]:
    if not obj:
        return [Violation("spec.objective", "must be specified", "webhook")]
    out = []
    if obj.get("type") not in ("minimize", "maximize"):
        out.append(Violation("spec.objective.type", f"{obj.get('type')!r} must be minimize or maximize", "webhook"))
    name = obj.get("objectiveMetricName") or ""
    if not name:
        out.append(Violation("spec.objective.objectiveMetricName", "must be specified", "webhook"))
    if name and name in (obj.get("additionalMetricNames") or []):
        out.append(
            Violation(
                "spec.objective.additionalMetricNames", f"should not contain the objective metric {name!r}", "webhook"
            )
        )
    for i, strategy in enumerate(obj.get("metricStrategies") or []):
        if strategy.get("value") not in METRIC_STRATEGIES:
            out.append(
                Violation(
                    f"spec.objective.metricStrategies[{i}].value",
                    f"{strategy.get('value')!r} is not one of min, max, latest",
                    "project",
                )
            )
    return out


def _check_algorithm(spec: Mapping[str, Any]) -> list[Violation]:
    algorithm = spec.get("algorithm")
    if not algorithm:
        return [Violation("spec.algorithm", "must be specified", "webhook")]
    name = algorithm.get("algorithmName") or ""
    if not name:
        return [Violation("spec.algorithm.algorithmName", "must be specified", "webhook")]
    if name not in KNOWN_ALGORITHMS:
        return [
            Violation(
                "spec.algorithm.algorithmName",
                f"unknown algorithm {name!r} (no Suggestion config in "
                f"katib-config); known: {', '.join(KNOWN_ALGORITHMS)}",
                "webhook",
            )
        ]
    out = _check_settings(
        algorithm.get("algorithmSettings") or [],
        ALGORITHM_SETTINGS.get(name),
        "spec.algorithm.algorithmSettings",
        name,
        "suggestion",
    )
    if name == "grid":
        out += _check_grid(spec)
    return out


def _check_settings(settings, allowed, path, algorithm, source) -> list[Violation]:
    if allowed is None:
        return []
    out = []
    for i, setting in enumerate(settings):
        key, value = setting.get("name"), setting.get("value")
        if key not in allowed:
            service = SUGGESTION_SERVICES.get(algorithm, algorithm)
            out.append(
                Violation(
                    f"{path}[{i}]",
                    f"unknown setting {key!r} for {algorithm} (served by Katib's "
                    f"{service} service); known: {', '.join(allowed)}",
                    source,
                )
            )
            continue
        expected, ok = allowed[key]
        try:
            good = ok(value)
        except (TypeError, ValueError):
            good = False
        if not good:
            out.append(Violation(f"{path}[{i}]", f"{key}={value!r} must be {expected}", source))
    return out


def _check_grid(spec: Mapping[str, Any]) -> list[Violation]:
    sizes = []
    for i, param in enumerate(spec.get("parameters") or []):
        space, ptype = param.get("feasibleSpace") or {}, param.get("parameterType")
        if ptype in ("categorical", "discrete"):
            sizes.append(len(space.get("list") or []))
        elif ptype == "double" and not space.get("step"):
            return [
                Violation(
                    f"spec.parameters[{i}].feasibleSpace.step",
                    "grid needs a step for every double parameter (or a discrete list)",
                    "suggestion",
                )
            ]
        else:
            try:
                low, high, step = (float(space.get(k) or d) for k, d in (("min", "nan"), ("max", "nan"), ("step", 1)))
                sizes.append(max(0, int((high - low) // step) + 1))
            except ValueError:
                return []  # reported by the parameter checks
    combinations = math.prod(sizes) if sizes else 0
    max_trials = spec.get("maxTrialCount")
    if max_trials is not None and max_trials > combinations:
        return [
            Violation(
                "spec.maxTrialCount",
                f"{max_trials} > the {combinations} grid combinations; lower it or add grid values",
                "suggestion",
            )
        ]
    return []


def _check_early_stopping(es: Mapping[str, Any] | None) -> list[Violation]:
    if es is None:
        return []
    name = es.get("algorithmName") or ""
    if not name:
        return [Violation("spec.earlyStopping.algorithmName", "must be specified", "webhook")]
    if name not in KNOWN_EARLY_STOPPING:
        return [
            Violation(
                "spec.earlyStopping.algorithmName",
                f"unknown early stopping algorithm {name!r}; known: {', '.join(KNOWN_EARLY_STOPPING)}",
                "webhook",
            )
        ]
    return _check_settings(
        es.get("algorithmSettings") or [],
        MEDIANSTOP_SETTINGS,
        "spec.earlyStopping.algorithmSettings",
        name,
        "earlystopping",
    )


def _check_parameters(spec: Mapping[str, Any]) -> list[Violation]:
    params = spec.get("parameters") or []
    if not params and not spec.get("nasConfig"):
        return [Violation("spec", "spec.parameters or spec.nasConfig must be specified", "webhook")]
    if params and spec.get("nasConfig"):
        return [Violation("spec", "only one of spec.parameters and spec.nasConfig can be specified", "webhook")]
    out = []
    for i, param in enumerate(params):
        out += _check_parameter(f"spec.parameters[{i}]", param)
    return out


def _check_parameter(path: str, param: Mapping[str, Any]) -> list[Violation]:
    ptype, space = param.get("parameterType", ""), param.get("feasibleSpace") or {}
    out = []
    if ptype not in PARAMETER_TYPES:
        out.append(Violation(f"{path}.parameterType", f"{ptype!r} is not supported", "webhook"))
    if space.get("distribution", "") not in DISTRIBUTIONS:
        out.append(
            Violation(
                f"{path}.feasibleSpace.distribution", f"{space.get('distribution')!r} is not supported", "webhook"
            )
        )
    if not any(space.get(k) not in (None, "", []) for k in ("min", "max", "step", "list", "distribution")):
        return out + [Violation(f"{path}.feasibleSpace", "feasibleSpace must be specified", "webhook")]
    if ptype in ("int", "double"):
        if space.get("list"):
            out.append(Violation(f"{path}.feasibleSpace.list", f"not supported for parameterType {ptype}", "webhook"))
        if not space.get("max") or not space.get("min"):
            out.append(Violation(f"{path}.feasibleSpace.max", f"max and min must be specified for {ptype}", "webhook"))
        else:
            out += _check_range(path, space)
    elif ptype in ("categorical", "discrete"):
        if any(space.get(k) for k in ("min", "max", "step")):
            out.append(
                Violation(f"{path}.feasibleSpace", f"max, min and step are not supported for {ptype}", "webhook")
            )
        if not space.get("list"):
            out.append(Violation(f"{path}.feasibleSpace.list", "empty list: nothing to search", "project"))
    return out


def _check_range(path: str, space: Mapping[str, Any]) -> list[Violation]:
    try:
        low, high = float(space["min"]), float(space["max"])
    except ValueError:
        return [
            Violation(
                f"{path}.feasibleSpace", f"min {space['min']!r} / max {space['max']!r} are not numbers", "suggestion"
            )
        ]
    if not low < high:
        return [Violation(f"{path}.feasibleSpace", f"empty range: min {space['min']} >= max {space['max']}", "project")]
    if space.get("distribution") == "logUniform" and low <= 0:
        return [Violation(f"{path}.feasibleSpace.min", "a logUniform range needs min > 0", "project")]
    return []


def _check_trial_template(spec: Mapping[str, Any]) -> list[Violation]:
    template = spec.get("trialTemplate")
    path = "spec.trialTemplate"
    if not template:
        return [Violation(path, "must be specified", "webhook")]
    out = []
    if not template.get("primaryContainerName"):
        out.append(Violation(f"{path}.primaryContainerName", "must be specified", "webhook"))
    if not template.get("successCondition") or not template.get("failureCondition"):
        out.append(Violation(path, "successCondition and failureCondition must be specified", "webhook"))
    if template.get("trialParameters") is None:
        return out + [Violation(f"{path}.trialParameters", "must be specified", "webhook")]
    has_spec, has_cm = template.get("trialSpec") is not None, template.get("configMap") is not None
    if has_spec == has_cm:
        return out + [Violation(path, "exactly one of trialSpec or configMap must be specified", "webhook")]
    if has_cm:
        return out  # the template lives in a ConfigMap this code cannot read
    text = json.dumps(template["trialSpec"])  # the webhook searches the JSON text of the template
    out += _check_trial_parameters(spec, template["trialParameters"], text)
    out += _check_trial_spec(template)
    return out


def _check_trial_parameters(spec: Mapping[str, Any], trial_params: list, text: str) -> list[Violation]:
    path = "spec.trialTemplate.trialParameters"
    searched = {p.get("name") for p in spec.get("parameters") or []}
    names: set[str] = set()
    refs: set[str] = set()
    out = []
    for i, param in enumerate(trial_params):
        name, ref = param.get("name") or "", param.get("reference") or ""
        if not name or not ref or "{" in name or "}" in name:
            out.append(
                Violation(f"{path}[{i}]", "name and reference must be set; name must not contain { or }", "webhook")
            )
            continue
        if name in names or ref in refs:
            what = "name" if name in names else "reference"
            out.append(
                Violation(f"{path}[{i}].{what}", f"duplicated {what} {name if what == 'name' else ref!r}", "webhook")
            )
            continue
        names.add(name)
        refs.add(ref)
        if searched and not _is_meta_key(ref) and ref not in searched:
            out.append(Violation(f"{path}[{i}].reference", f"{ref!r} is not a parameter in spec.parameters", "webhook"))
        if PARAM_FORMAT % name not in text:
            out.append(Violation(f"{path}[{i}].name", f"{PARAM_FORMAT % name} is not used in trialSpec", "webhook"))
            return out
        text = text.replace(PARAM_FORMAT % name, "test-value")
    left = PARAM_RE.findall(text)
    if left:
        out.append(
            Violation("spec.trialTemplate.trialSpec", f"{sorted(set(left))} are not in trialParameters", "webhook")
        )
    return out


def _is_meta_key(reference: str) -> bool:
    match = META_RE.search(reference)
    if not match:
        return False
    key = match.group(1)
    sub = META_INDEX_RE.search(key)
    return key in TRIAL_META_KEYS or bool(sub and sub.group(1) in TRIAL_META_KEYS)


def _check_trial_spec(template: Mapping[str, Any]) -> list[Violation]:
    trial_spec, path = template["trialSpec"], "spec.trialTemplate.trialSpec"
    metadata = trial_spec.get("metadata") or {}
    out = []
    if metadata.get("name") or metadata.get("namespace"):
        out.append(Violation(f"{path}.metadata", "metadata.name and metadata.namespace must be omitted", "webhook"))
    if not trial_spec.get("apiVersion") or not trial_spec.get("kind"):
        out.append(Violation(path, "apiVersion and kind must be specified", "webhook"))
    kind = _registered_kind(trial_spec.get("kind"))
    if kind is not None:
        out += _TEMPLATE_CHECKS.get(kind.kind, _check_registered_template)(template)
    return out


def _registered_kind(kind: str | None):
    """The registered TrialKind named ``kind`` (by kind, whatever the apiVersion, as Katib's own rules read it)."""
    return next((k for k in TRIAL_KINDS.values() if k.kind == kind), None)


def _check_registered_template(template: Mapping[str, Any]) -> list[Violation]:
    """Trials of a kind a training backend registered (llmft/components/lib/jobs/backends.py): Katib's fields as
    that kind's TrialKind says, and a trainer command to run."""
    trial_spec = template["trialSpec"]
    kind = _registered_kind(trial_spec.get("kind"))
    assert kind is not None  # _check_trial_spec looked it up
    expected = {
        "primaryContainerName": kind.primary_container_name,
        "successCondition": kind.success_condition,
        "failureCondition": kind.failure_condition,
        "primaryPodLabels": dict(kind.primary_pod_labels),
    }
    out = [
        Violation(
            f"spec.trialTemplate.{key}", f"{kind.kind} trials need {value!r}; got {template.get(key)!r}", "project"
        )
        for key, value in expected.items()
        if (dict(template.get(key) or {}) if key == "primaryPodLabels" else template.get(key)) != value
    ]
    if kind.command_holder(trial_spec) is None:
        out.append(Violation("spec.trialTemplate.trialSpec", kind.container_rule, "project"))
    return out


def _check_trainjob_template(template: Mapping[str, Any]) -> list[Violation]:
    """TrainJob trials (llmft/katib/trial_kinds.py): Katib's TrainJob defaults, and a trainer command to run."""

    path = "spec.trialTemplate"
    out = []
    expected = {
        "primaryContainerName": TRAINJOB.primary_container_name,
        "successCondition": TRAINJOB.success_condition,
        "failureCondition": TRAINJOB.failure_condition,
    }
    for key, value in expected.items():
        if template.get(key) != value:
            out.append(
                Violation(
                    f"{path}.{key}",
                    f"TrainJob trials need {value!r} (a TrainJob reports Complete/Failed and runs container 'node'); "
                    f"got {template.get(key)!r}",
                    "project",
                )
            )
    if dict(template.get("primaryPodLabels") or {}) != dict(TRAINJOB.primary_pod_labels):
        out.append(
            Violation(
                f"{path}.primaryPodLabels",
                f"TrainJob trials collect metrics from node 0 only: {dict(TRAINJOB.primary_pod_labels)}",
                "project",
            )
        )
    spec = template["trialSpec"].get("spec") or {}
    if not (spec.get("runtimeRef") or {}).get("name"):
        out.append(Violation(f"{path}.trialSpec.spec.runtimeRef.name", "required by the TrainJob CRD", "webhook"))
    if TRAINJOB.command_holder(template["trialSpec"]) is None:
        out.append(
            Violation(
                f"{path}.trialSpec.spec.trainer",
                "no command: the runtime's own image command would run, printing no metrics",
                "project",
            )
        )
    return out


def _check_pytorchjob_template(template: Mapping[str, Any]) -> list[Violation]:
    path = "spec.trialTemplate"
    out = []
    if template.get("primaryContainerName") != "pytorch":
        out.append(
            Violation(f"{path}.primaryContainerName", "PyTorchJob trials must name the container 'pytorch'", "project")
        )
    if template.get("successCondition") != KUBEFLOW_SUCCESS or template.get("failureCondition") != KUBEFLOW_FAILURE:
        out.append(
            Violation(
                path,
                f"PyTorchJob trials need successCondition {KUBEFLOW_SUCCESS} and failureCondition {KUBEFLOW_FAILURE}",
                "project",
            )
        )
    replicas = (template["trialSpec"].get("spec") or {}).get("pytorchReplicaSpecs") or {}
    containers = (((replicas.get("Master") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    if not any(c.get("name") == template.get("primaryContainerName") for c in containers):
        out.append(
            Violation(
                f"{path}.trialSpec.spec.pytorchReplicaSpecs.Master",
                f"no container named {template.get('primaryContainerName')!r}: Katib could not collect metrics",
                "project",
            )
        )
    return out


def _check_metrics_collector(mc: Mapping[str, Any]) -> list[Violation]:
    kind = (mc.get("collector") or {}).get("kind") or "StdOut"  # the defaulter sets StdOut
    if kind not in COLLECTOR_KINDS:
        return [
            Violation("spec.metricsCollectorSpec.collector.kind", f"invalid metrics collector kind {kind!r}", "webhook")
        ]
    # v0.19 returns before checking filters for StdOut/Push, yet the collector still needs them right.
    source = "project" if kind in ("StdOut", "Push") else "webhook"
    out = []
    for i, fmt in enumerate(((mc.get("source") or {}).get("filter") or {}).get("metricsFormat") or []):
        where = f"spec.metricsCollectorSpec.source.filter.metricsFormat[{i}]"
        try:
            re.compile(fmt)
        except re.error as exc:
            out.append(Violation(where, f"invalid filter: {exc}", source))
            continue
        if not TWO_GROUPS_RE.match(fmt):
            out.append(Violation(where, "two top subexpressions (name, value) are required", source))
        if re.search(r"\(\?<?[=!]|\\[1-9]", fmt):
            out.append(Violation(where, "lookarounds and backreferences do not compile in Go (RE2)", "project"))
    return out


_TEMPLATE_CHECKS = {"PyTorchJob": _check_pytorchjob_template, "TrainJob": _check_trainjob_template}
"""The checks written for the two built-in trial kinds; any other registered kind gets
:func:`_check_registered_template`."""
