"""Read an Experiment's status: phase, trial counts and the best hyperparameters.

Also the submit / get / wait path, written against a duck-typed client with the
methods of ``llmft.components.lib.cluster.Cluster`` (llmft/katib/ is a leaf and never imports it)::

    client.create_custom_object(group, version, plural, body, namespace=None) -> dict
    client.get_custom_object(group, version, plural, name, namespace=None) -> dict

The best trial's parameters come back as ``key=value`` lines keyed by the trainer's
config names, read from the Experiment's own trial command, ready for
``llmft train`` or the pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from llmft.katib.errors import ExperimentFailed, SweepError, SweepTimeout
from llmft.katib.experiment import GROUP, PLURAL, VERSION, experiment_dict, override_bindings

if TYPE_CHECKING:
    from kubeflow_katib_api.models import V1beta1ExperimentStatus

TERMINAL = ("Succeeded", "Failed")


class CustomObjectClient(Protocol):
    """What the submit/status path needs from a cluster client."""

    def create_custom_object(
        self, group: str, version: str, plural: str, body: dict, namespace: str | None = None
    ) -> dict: ...

    def get_custom_object(
        self, group: str, version: str, plural: str, name: str, namespace: str | None = None
    ) -> dict: ...


@dataclass(frozen=True)
class ExperimentState:
    """What a person (or the pipeline) needs to know about an Experiment right now."""

    name: str
    """metadata.name."""
    phase: str
    """Latest true condition: Created, Running, Restarting, Succeeded, Failed (or Pending before any)."""
    reason: str = ""
    """The condition's reason, e.g. ExperimentMaxTrialsReached."""
    message: str = ""
    """The condition's message."""
    trials: dict[str, int] = field(default_factory=dict)
    """Counts: total, succeeded, failed, running, pending, killed, early_stopped, metrics_unavailable."""
    best_trial: str | None = None
    """status.currentOptimalTrial.bestTrialName."""
    best_metrics: dict[str, float] = field(default_factory=dict)
    """The best trial's metrics (each by its strategy's value: min for eval_loss)."""
    best_parameters: dict[str, str] = field(default_factory=dict)
    """The best trial's assignments keyed by the trainer config key (Katib name where unbound)."""
    unbound: tuple[str, ...] = ()
    """Assigned parameters the trial command binds to no trainer key (a hand-edited template)."""

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL

    def best_overrides(self) -> list[str]:
        """``key=value`` lines for the best trial (empty before any trial reported the objective)."""
        return [f"{k}={v}" for k, v in self.best_parameters.items()]

    def summary(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in self.trials.items() if v)
        lines = [
            f"experiment {self.name}: {self.phase}" + (f" ({self.reason})" if self.reason else ""),
            f"trials: {counts or 'none yet'}",
        ]
        if self.message:
            lines.append(f"message: {self.message}")
        if self.best_trial:
            metrics = " ".join(f"{k}={v:.6g}" for k, v in self.best_metrics.items())
            lines.append(f"best trial: {self.best_trial} {metrics}")
            lines.extend(f"  {line}" for line in self.best_overrides())
        return "\n".join(lines)


_COUNT_FIELDS = {
    "total": "trials",
    "succeeded": "trialsSucceeded",
    "failed": "trialsFailed",
    "running": "trialsRunning",
    "pending": "trialsPending",
    "killed": "trialsKilled",
    "early_stopped": "trialsEarlyStopped",
    "metrics_unavailable": "trialMetricsUnavailable",
}


def parse_state(experiment: Mapping[str, Any]) -> ExperimentState:
    """The :class:`ExperimentState` of an Experiment dict as the API server returns it."""
    # heavy: kubeflow_katib_api, pydantic
    from kubeflow_katib_api.models import V1beta1ExperimentStatus

    body = experiment_dict(experiment)
    raw_status = body.get("status") or {}
    try:
        status = V1beta1ExperimentStatus.from_dict(raw_status) if raw_status else None
    except ValueError as exc:
        raise SweepError(f"experiment {body.get('metadata', {}).get('name')}: status does not parse: {exc}") from None
    condition = _latest_true_condition(status)
    optimal = status.current_optimal_trial if status else None
    bindings = override_bindings(body)
    assignments = (optimal.parameter_assignments or []) if optimal else []
    params = {bindings.get(a.name, a.name): a.value for a in assignments}
    strategies = _strategies(body)
    metrics = {}
    for metric in (optimal.observation.metrics or []) if optimal and optimal.observation else []:
        value = getattr(metric, strategies.get(metric.name, "latest"), None) or metric.latest
        if value not in (None, "", "unavailable"):
            metrics[metric.name] = float(value)
    return ExperimentState(
        name=(body.get("metadata") or {}).get("name", ""),
        phase=condition.type if condition else "Pending",
        reason=(condition.reason or "") if condition else "",
        message=(condition.message or "") if condition else "",
        trials={k: raw_status.get(v, 0) or 0 for k, v in _COUNT_FIELDS.items()},
        best_trial=(optimal.best_trial_name or None) if optimal else None,
        best_metrics=metrics,
        best_parameters=params,
        unbound=tuple(a.name for a in assignments if a.name not in bindings),
    )


def _latest_true_condition(status: V1beta1ExperimentStatus | None):
    conditions = [c for c in (status.conditions or []) if c.status == "True"] if status else []
    terminal = [c for c in conditions if c.type in TERMINAL]
    if terminal:
        return terminal[-1]
    return conditions[-1] if conditions else None


def _strategies(body: Mapping[str, Any]) -> dict[str, str]:
    objective = (body.get("spec") or {}).get("objective") or {}
    return {s.get("name"): s.get("value") for s in objective.get("metricStrategies") or []}


def best_overrides(experiment: Mapping[str, Any]) -> list[str]:
    """``key=value`` lines of the optimal trial; :class:`SweepError` when there is none yet."""
    state = parse_state(experiment)
    if not state.best_parameters:
        raise SweepError(
            f"experiment {state.name}: no optimal trial yet ({state.phase}; "
            f"{state.trials.get('succeeded', 0)} trials succeeded). Check `llmft sweep status {state.name}`"
        )
    if state.unbound:
        raise SweepError(
            f"experiment {state.name}: parameters {list(state.unbound)} are not bound to a trainer key "
            "in the trial command (expected <key>=${trialParameters.<name>}); fix the trial template"
        )
    return state.best_overrides()


# --- cluster path ------------------------------------------------------------------------------


def submit(
    client: CustomObjectClient, experiment: Mapping[str, Any], namespace: str | None = None, *, exist_ok: bool = True
) -> dict:
    """Create the Experiment; with ``exist_ok`` an Experiment of the same name and spec is reused
    (a retried pipeline task must not fail on its own earlier submission)."""
    body = experiment_dict(experiment)
    namespace = namespace or (body.get("metadata") or {}).get("namespace")
    try:
        return client.create_custom_object(GROUP, VERSION, PLURAL, body, namespace=namespace)
    except Exception as exc:  # noqa: BLE001 - the client's ApiException, duck-typed
        if getattr(exc, "status", None) != 409 or not exist_ok:
            raise
    name = body["metadata"]["name"]
    existing = client.get_custom_object(GROUP, VERSION, PLURAL, name, namespace=namespace)
    if (existing.get("spec") or {}).get("parameters") != body["spec"].get("parameters") or (
        existing.get("spec") or {}
    ).get("algorithm") != body["spec"].get("algorithm"):
        raise SweepError(
            f"experiment {name} already exists in namespace {namespace} with a different search; "
            "pick another name= or delete it (kubectl delete experiment " + name + ")"
        )
    return existing


def get_state(client: CustomObjectClient, name: str, namespace: str | None = None) -> ExperimentState:
    return parse_state(client.get_custom_object(GROUP, VERSION, PLURAL, name, namespace=namespace))


def wait(
    client: CustomObjectClient,
    name: str,
    namespace: str | None = None,
    *,
    timeout_s: float = 24 * 3600,
    poll_s: float = 30.0,
    on_update: Callable[[ExperimentState], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> ExperimentState:
    """Poll until Succeeded (returned) or Failed (:class:`ExperimentFailed`); :class:`SweepTimeout`
    (a TimeoutError) after ``timeout_s``."""
    deadline = clock() + timeout_s
    last_summary = None
    while True:
        state = get_state(client, name, namespace)
        if on_update and state.summary() != last_summary:
            on_update(state)
            last_summary = state.summary()
        if state.phase == "Failed":
            raise ExperimentFailed(
                f"experiment {name} failed: {state.reason} {state.message}".strip() + f"\n{state.summary()}", state
            )
        if state.phase == "Succeeded":
            return state
        if clock() >= deadline:
            raise SweepTimeout(f"experiment {name} still {state.phase} after {timeout_s:.0f}s\n{state.summary()}")
        sleep(poll_s)
