"""Build the Katib Experiment (kubeflow.org/v1beta1) that sweeps the training step.

The Experiment is built from Katib's own typed API models (``kubeflow-katib-api``)
and its trial template is the project's PyTorchJob, given as a plain dict with
``${trialParameters.<name>}`` placeholders in the trainer's ``key=value``
overrides. llmft/katib/ builds no job itself; the callers (``llmft sweep``, the KFP sweep
component) render it with ``llmft.components.lib.jobs.katib_sweep.sweep_trial_job`` (the trainer's
``llmft train --config <run_dir>/config.yaml data=... output_dir=<trial> <fixed> <searched>``)
and pass the dict in::

    spec = SweepSpec(algorithm="tpe", max_trials=12)
    job = sweep_trial_job(spec, job=plan.job, data=tokenized, config_path=plan.trainer.config_path)
    experiment = build_experiment(spec, job)          # V1beta1Experiment
    body = experiment.to_dict()                       # what the API server receives

Trials reuse the tokenized shards already on the PVC: the job's trainer command
points at the existing data directory and never tokenizes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmft.katib import search_space as ss
from llmft.katib.errors import SweepError
from llmft.katib.metrics import ADDITIONAL_METRICS, METRICS_FILTER, OBJECTIVE_METRIC
from llmft.katib.trial_kinds import EXPERIMENT_RESOURCE, PYTORCHJOB, TRIAL_KINDS, trial_kind
from llmft.trainer.config_load import parse_bool, split_assignment
from llmft.trainer.errors import ConfigError

if TYPE_CHECKING:
    from kubeflow_katib_api.models import (
        V1beta1AlgorithmSetting,
        V1beta1EarlyStoppingSpec,
        V1beta1Experiment,
        V1beta1ObjectiveSpec,
        V1beta1TrialTemplate,
    )

# Katib's typed API models (kubeflow_katib_api, pydantic: ~0.5 s, 500+ modules) load only where a Katib object is
# built or parsed: the plan step reads SweepSpec, its overrides and the trial command without them.

GROUP, VERSION, PLURAL, KIND = EXPERIMENT_RESOURCE
API_VERSION = f"{GROUP}/{VERSION}"

# What this project lets a user pick; Katib knows more (see webhook_rules.KNOWN_ALGORITHMS).
ALGORITHMS = ("random", "tpe", "grid", "bayesianoptimization")
RESUME_POLICIES = ("Never", "LongRunning", "FromVolume")

# PyTorchJob trials (platform-facts.md; Katib's DefaultKubeflowJob* constants); TrainJob: llmft/katib/trial_kinds.py.
PRIMARY_CONTAINER = PYTORCHJOB.primary_container_name
SUCCESS_CONDITION = PYTORCHJOB.success_condition
FAILURE_CONDITION = PYTORCHJOB.failure_condition
PRIMARY_POD_LABELS = dict(PYTORCHJOB.primary_pod_labels)  # metrics come from the master pod only

# A trial parameter bound to Katib's trial metadata (not searched): each trial's own
# name, so every trial writes to its own output_dir and `resume=auto` never picks up
# another trial's checkpoints.
TRIAL_NAME_PARAMETER = "trial_name"
TRIAL_NAME_REFERENCE = "${trialSpec.Name}"
TRIAL_NAME_PLACEHOLDER = ss.trial_placeholder(TRIAL_NAME_PARAMETER)

_PLACEHOLDER_RE = re.compile(r"\$\{trialParameters\.(.+?)\}")  # Katib's TrialTemplateParamReplaceFormatRegex
_BINDING_RE = re.compile(r"^([A-Za-z_][\w.\-]*)=\$\{trialParameters\.([^}]+)\}$")


@dataclass(frozen=True)
class SweepSpec:
    """Everything about a sweep except the trial job itself (which the caller renders)."""

    name: str = "llmft-sweep"
    """Experiment name: at most 40 characters of [a-z0-9-], starting with a letter."""
    namespace: str | None = None
    """Namespace of the Experiment (None: the caller's current namespace)."""
    algorithm: str = "tpe"
    """Suggestion algorithm: random, tpe, grid or bayesianoptimization."""
    max_trials: int = 12
    """spec.maxTrialCount: trials to run in total."""
    parallel_trials: int = 3
    """spec.parallelTrialCount: trials running at once (<= max_trials)."""
    max_failed_trials: int = 3
    """spec.maxFailedTrialCount: failed trials after which the Experiment fails (<= max_trials)."""
    resume_policy: str = "Never"
    """spec.resumePolicy: Never, LongRunning (keep the suggestion service) or FromVolume."""
    early_stopping: bool = True
    """Stop trials whose eval loss is worse than the median of finished trials (Katib medianstop)."""
    median_stop_min_trials: int = 3
    """medianstop min_trials_required: finished trials needed before any trial is stopped."""
    median_stop_start_step: int = 2
    """medianstop start_step: eval reports a trial makes before it can be stopped."""
    seed: int = 42
    """random_state of the suggestion algorithm (reproducible suggestions)."""
    objective_metric: str = OBJECTIVE_METRIC
    """Metric to minimize, as printed by the trainer (`eval_loss=<v>`)."""
    additional_metrics: tuple[str, ...] = ADDITIONAL_METRICS
    """Other metrics collected from the same lines (`perplexity=<v>`)."""
    retain_trials: bool = False
    """trialTemplate.retain: keep finished trial jobs and pods (for reading their logs)."""
    search_space: tuple[ss.HyperParameter, ...] = field(default=ss.DEFAULT_SEARCH_SPACE)
    """The searched hyperparameters (override with space.<name>.<field>=<value>)."""

    def check(self) -> None:
        """Raise :class:`SweepError` naming the field and the fix."""
        if self.algorithm not in ALGORITHMS:
            raise SweepError(f"algorithm={self.algorithm}: choose one of {', '.join(ALGORITHMS)}")
        if self.resume_policy not in RESUME_POLICIES:
            raise SweepError(f"resume_policy={self.resume_policy}: choose one of {', '.join(RESUME_POLICIES)}")
        for name in ("max_trials", "parallel_trials", "median_stop_min_trials", "median_stop_start_step"):
            if getattr(self, name) < 1:
                raise SweepError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.max_failed_trials < 0:
            raise SweepError(f"max_failed_trials={self.max_failed_trials}: must be 0 or more")
        if self.objective_metric in self.additional_metrics:
            raise SweepError(f"additional_metrics must not repeat the objective {self.objective_metric!r}")
        ss.check_space(self.search_space)


def trial_overrides(spec: SweepSpec) -> list[str]:
    """Trainer arguments the trial command must carry: ``<config_key>=${trialParameters.<name>}``."""
    return [p.override() for p in spec.search_space]


def algorithm_settings(spec: SweepSpec) -> list[V1beta1AlgorithmSetting]:
    """Settings the suggestion service behind each algorithm accepts (its ValidateAlgorithmSettings).

    Katib 0.19's default katib-config serves random and tpe with its Hyperopt service (which
    knows random_state, and for tpe gamma, prior_weight, n_EI_candidates), grid with its Optuna
    service and bayesianoptimization with scikit-optimize; an unknown setting fails the Experiment.
    """
    # heavy: kubeflow_katib_api, pydantic
    from kubeflow_katib_api.models import V1beta1AlgorithmSetting

    seed = str(spec.seed)
    by_algorithm: dict[str, list[tuple[str, str]]] = {
        "random": [("random_state", seed)],
        "grid": [("random_state", seed)],
        "tpe": [("random_state", seed)],
        "bayesianoptimization": [
            ("random_state", seed),
            ("base_estimator", "GP"),
            ("n_initial_points", str(min(5, spec.max_trials))),
            ("acq_func", "gp_hedge"),
        ],
    }
    return [V1beta1AlgorithmSetting(name=k, value=v) for k, v in by_algorithm[spec.algorithm]]


def build_experiment(spec: SweepSpec, trial_job: Mapping[str, Any]) -> V1beta1Experiment:
    """The Experiment for ``spec`` whose trials run ``trial_job`` (a PyTorchJob dict with placeholders)."""
    # heavy: kubeflow_katib_api, pydantic
    from kubeflow_katib_api.models import (
        IoK8sApimachineryPkgApisMetaV1ObjectMeta,
        V1beta1AlgorithmSpec,
        V1beta1CollectorSpec,
        V1beta1Experiment,
        V1beta1ExperimentSpec,
        V1beta1FilterSpec,
        V1beta1MetricsCollectorSpec,
        V1beta1SourceSpec,
    )

    spec.check()
    trial_spec = trial_spec_from_job(trial_job, spec)
    metadata = {
        "name": spec.name,
        "labels": {"app.kubernetes.io/part-of": "kfp-llm-finetune", "app.kubernetes.io/component": "sweep"},
    }
    if spec.namespace:
        metadata["namespace"] = spec.namespace
    return V1beta1Experiment(
        apiVersion=API_VERSION,
        kind=KIND,
        metadata=IoK8sApimachineryPkgApisMetaV1ObjectMeta.from_dict(metadata),
        spec=V1beta1ExperimentSpec(
            algorithm=V1beta1AlgorithmSpec(algorithmName=spec.algorithm, algorithmSettings=algorithm_settings(spec)),
            earlyStopping=_early_stopping(spec),
            objective=objective_spec(spec),
            metricsCollectorSpec=V1beta1MetricsCollectorSpec(
                collector=V1beta1CollectorSpec(kind="StdOut"),
                source=V1beta1SourceSpec(filter=V1beta1FilterSpec(metricsFormat=[METRICS_FILTER])),
            ),
            parameters=ss.parameter_specs(spec.search_space, spec.algorithm),
            maxTrialCount=spec.max_trials,
            parallelTrialCount=spec.parallel_trials,
            maxFailedTrialCount=spec.max_failed_trials,
            resumePolicy=spec.resume_policy,
            trialTemplate=_trial_template(spec, trial_spec),
        ),
    )


def objective_spec(spec: SweepSpec) -> V1beta1ObjectiveSpec:
    # heavy: kubeflow_katib_api, pydantic
    from kubeflow_katib_api.models import V1beta1MetricStrategy, V1beta1ObjectiveSpec

    metrics = (spec.objective_metric, *spec.additional_metrics)
    return V1beta1ObjectiveSpec(
        type="minimize",
        objectiveMetricName=spec.objective_metric,
        additionalMetricNames=list(spec.additional_metrics),
        # Explicit (Katib's defaulter would pick the same): the best eval over a trial, not its last.
        metricStrategies=[V1beta1MetricStrategy(name=m, value="min") for m in metrics],
    )


def _early_stopping(spec: SweepSpec) -> V1beta1EarlyStoppingSpec | None:
    # heavy: kubeflow_katib_api, pydantic
    from kubeflow_katib_api.models import V1beta1EarlyStoppingSetting, V1beta1EarlyStoppingSpec

    if not spec.early_stopping:
        return None
    return V1beta1EarlyStoppingSpec(
        algorithmName="medianstop",
        algorithmSettings=[
            V1beta1EarlyStoppingSetting(name="min_trials_required", value=str(spec.median_stop_min_trials)),
            V1beta1EarlyStoppingSetting(name="start_step", value=str(spec.median_stop_start_step)),
        ],
    )


def _trial_template(spec: SweepSpec, trial_spec: dict[str, Any]) -> V1beta1TrialTemplate:
    # heavy: kubeflow_katib_api, pydantic
    from kubeflow_katib_api.models import V1beta1TrialParameterSpec, V1beta1TrialTemplate

    params = [
        V1beta1TrialParameterSpec(
            name=p.name, reference=p.name, description=f"{p.config_key}: {p.description}".rstrip(": ")
        )
        for p in spec.search_space
    ]
    if TRIAL_NAME_PLACEHOLDER in json.dumps(trial_spec):
        params.append(
            V1beta1TrialParameterSpec(
                name=TRIAL_NAME_PARAMETER,
                reference=TRIAL_NAME_REFERENCE,
                description="the trial's own name (per-trial output_dir)",
            )
        )
    kind = trial_kind(trial_spec)  # PyTorchJob or TrainJob trials (llmft/katib/trial_kinds.py)
    return V1beta1TrialTemplate(
        primaryContainerName=kind.primary_container_name,
        primaryPodLabels=dict(kind.primary_pod_labels),
        successCondition=kind.success_condition,
        failureCondition=kind.failure_condition,
        retain=spec.retain_trials or None,
        trialParameters=params,
        trialSpec=trial_spec,
    )


def trial_spec_from_job(trial_job: Mapping[str, Any], spec: SweepSpec) -> dict[str, Any]:
    """A copy of the trial job (PyTorchJob or TrainJob) fit for ``trialTemplate.trialSpec``: checked, name and
    namespace removed."""
    job = copy.deepcopy(dict(trial_job))
    master = primary_container(job)
    if master is None:
        raise SweepError(f"trial job: {trial_kind(job).container_rule}")
    metadata = {k: v for k, v in (job.get("metadata") or {}).items() if k not in ("name", "namespace")}
    job["metadata"] = metadata
    if not metadata:
        job.pop("metadata")
    text = json.dumps(job)
    known = {p.name for p in spec.search_space} | {TRIAL_NAME_PARAMETER}
    missing = [p.override() for p in spec.search_space if p.placeholder() not in text]
    if missing:
        raise SweepError(
            "trial job: the trainer command lacks "
            + " ".join(missing)
            + "; render the job with katib.experiment.trial_overrides(spec) appended to its args"
        )
    unknown = sorted(set(_PLACEHOLDER_RE.findall(text)) - known)
    if unknown:
        raise SweepError(f"trial job: placeholders for unknown trial parameters {unknown}; known: {sorted(known)}")
    return job


def primary_container(job: Mapping[str, Any]) -> dict[str, Any] | None:
    """Where the trainer's command is: the ``pytorch`` container of a PyTorchJob's Master replica, a
    TrainJob's ``spec.trainer``; None when missing or for another kind of job."""
    kind = TRIAL_KINDS.get((job.get("apiVersion"), job.get("kind")))
    return kind.command_holder(job) if kind else None


def override_bindings(experiment: Mapping[str, Any] | V1beta1Experiment) -> dict[str, str]:
    """``{katib parameter name: trainer config key}`` read from the trial command's ``key=${trialParameters.x}``.

    Read from the Experiment itself (not the default space), so it also holds for an
    edited YAML template and for an Experiment fetched back from the cluster.
    """
    body = experiment if isinstance(experiment, Mapping) else experiment.to_dict()
    template = (body.get("spec") or {}).get("trialTemplate") or {}
    searched = {p.get("name") for p in (body.get("spec") or {}).get("parameters") or []}
    refs = {
        p.get("name"): p.get("reference")
        for p in template.get("trialParameters") or []
        if p.get("reference") in searched
    }
    container = primary_container(template.get("trialSpec") or {}) or {}
    bindings: dict[str, str] = {}
    for token in [*(container.get("command") or []), *(container.get("args") or [])]:
        for word in str(token).split():
            match = _BINDING_RE.match(word)
            if match and match.group(2) in refs:
                bindings[refs[match.group(2)]] = match.group(1)
    return bindings


# --- parsing and (de)serialising -------------------------------------------------------------


def parse_experiment(body: Mapping[str, Any]) -> V1beta1Experiment:
    """Parse a dict into the typed models, refusing fields the models do not know.

    The generated pydantic models silently drop unknown keys (a misspelt
    ``primaryContainername`` would vanish and the API server would accept it,
    since the CRD schema is open); a round trip catches them.
    """
    # heavy: kubeflow_katib_api, pydantic
    from kubeflow_katib_api.models import V1beta1Experiment

    try:
        model = V1beta1Experiment.from_dict(dict(body))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError whose errors() name each field
        errors = getattr(exc, "errors", None)
        if not callable(errors):
            raise
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors())
        hint = (
            (" (Katib types feasibleSpace bounds and algorithm settings as strings: quote them, e.g. min: '1e-05')")
            if "valid string" in problems
            else ""
        )
        raise SweepError(f"Experiment does not parse into Katib's API models: {problems}{hint}") from None
    dumped = model.to_dict()
    dropped = [
        path
        for key in ("apiVersion", "kind", "metadata", "spec")
        for path in _dropped_paths(body.get(key), dumped.get(key), key)
    ]
    if dropped:
        raise SweepError("Experiment has fields Katib's API does not define (misspelt?): " + ", ".join(dropped))
    return model


def _dropped_paths(original: Any, dumped: Any, path: str) -> list[str]:
    if path.endswith(".trialSpec"):
        return []  # free-form (unstructured) in the API
    if isinstance(original, Mapping):
        dumped = dumped if isinstance(dumped, Mapping) else {}
        out = []
        for key, value in original.items():
            if value is None:
                continue
            if key not in dumped:
                out.append(f"{path}.{key}")
            else:
                out.extend(_dropped_paths(value, dumped[key], f"{path}.{key}"))
        return out
    if isinstance(original, list) and isinstance(dumped, list):
        return [
            p
            for i, (o, d) in enumerate(zip(original, dumped, strict=False))
            for p in _dropped_paths(o, d, f"{path}[{i}]")
        ]
    return []


def experiment_dict(experiment: V1beta1Experiment | Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-ready body (camelCase keys, no nulls)."""
    if isinstance(experiment, Mapping):  # not a typed model: those are no Mapping
        return json.loads(json.dumps(experiment))
    return json.loads(experiment.to_json())


# --- key=value overrides -----------------------------------------------------------------------


def apply_overrides(spec: SweepSpec, overrides: Sequence[str]) -> SweepSpec:
    """``SweepSpec`` with ``key=value`` overrides applied (``space.<name>.<field>=v`` edits the search space)."""
    fields = {f.name: f for f in dataclasses.fields(SweepSpec) if f.name != "search_space"}
    hints = typing.get_type_hints(SweepSpec)
    for item in overrides:
        try:
            key, value = split_assignment(item, "max_trials=8")
        except ConfigError as exc:
            raise SweepError(f"override {exc}") from None
        if key.startswith("space."):
            spec = dataclasses.replace(spec, search_space=ss.with_override(spec.search_space, key[6:], value))
            continue
        if key not in fields:
            raise SweepError(f"unknown sweep setting {key!r}; known: {', '.join(sorted(fields))}, space.<name>.<field>")
        spec = dataclasses.replace(spec, **{key: _coerce(key, value, hints[key])})
    spec.check()
    return spec


def _coerce(key: str, value: str, hint: Any) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if value.lower() in ("", "none", "null"):
            return None
        hint = next(a for a in args if a is not type(None))
    try:
        if hint is bool:
            return parse_bool(value)
        if hint is int:
            return int(value)
        if typing.get_origin(hint) is tuple:
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value
    except ValueError:
        raise SweepError(f"{key}={value}: expected {getattr(hint, '__name__', hint)}") from None
