"""The Katib Experiment as YAML: written for ``kubectl apply -f`` (keys in a readable order, number-like strings
quoted for YAML 1.2 readers) and read back strictly (bounded, then parsed into Katib's API models, unknown fields
refused). ``llmft sweep create --output`` and ``--from-yaml``, the sweep step's ``experiment.yaml`` and the
checkout's ``katib/`` templates go through here; the Experiment itself is built in experiment.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from llmft.katib.errors import SweepError
from llmft.katib.experiment import experiment_dict, parse_experiment
from llmft.trainer.errors import ConfigError
from llmft.trainer.yaml_limits import load_user_yaml, read_yaml_text

if TYPE_CHECKING:
    from kubeflow_katib_api.models import V1beta1Experiment

# Strings a YAML 1.2 reader (kubectl, Go) would read as a number, bool or null. PyYAML
# follows YAML 1.1 and writes e.g. `1e-05` unquoted, which kubectl then sends as a
# float and Katib's Go types (min/max are strings) refuse. Quote them all.
_YAML12_NON_STRING = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)?\.?[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"
    r"|0x[0-9a-fA-F]+|0o[0-7]+|true|True|TRUE|false|False|FALSE|yes|Yes|no|No|on|On|off|Off|null|Null|NULL|~|)$"
)


class _QuotingDumper(yaml.SafeDumper):
    pass


def _represent_str(dumper: yaml.SafeDumper, value: str):
    style = "'" if _YAML12_NON_STRING.match(value) else None
    if "\n" in value:
        style = "|"
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_QuotingDumper.add_representer(str, _represent_str)


def kubectl_yaml(body: Mapping[str, Any]) -> str:
    """``body`` as YAML a YAML 1.2 reader (kubectl) reads back as written: number-like strings quoted, multi-line
    strings as blocks, keys in ``body``'s order (the one rule for every manifest llmft writes)."""
    return yaml.dump(body, Dumper=_QuotingDumper, sort_keys=False, width=120, default_flow_style=False)


def to_yaml(experiment: V1beta1Experiment | Mapping[str, Any], header: str = "") -> str:
    """YAML for ``kubectl apply -f``: keys in a readable order, number-like strings quoted."""
    text = kubectl_yaml(_ordered(experiment_dict(experiment)))
    prefix = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return prefix + text


_KEY_ORDER = (
    "apiVersion",
    "kind",
    "metadata",
    "name",
    "namespace",
    "labels",
    "spec",
    "objective",
    "type",
    "objectiveMetricName",
    "additionalMetricNames",
    "metricStrategies",
    "algorithm",
    "algorithmName",
    "algorithmSettings",
    "earlyStopping",
    "maxTrialCount",
    "parallelTrialCount",
    "maxFailedTrialCount",
    "resumePolicy",
    "metricsCollectorSpec",
    "parameters",
    "parameterType",
    "feasibleSpace",
    "trialTemplate",
    "primaryContainerName",
    "primaryPodLabels",
    "successCondition",
    "failureCondition",
    "retain",
    "trialParameters",
    "trialSpec",
)


def _ordered(value: Any) -> Any:
    if isinstance(value, dict):
        rank = {k: i for i, k in enumerate(_KEY_ORDER)}
        keys = sorted(value, key=lambda k: (rank.get(k, len(rank)), list(value).index(k)))
        return {k: _ordered(value[k]) for k in keys}
    if isinstance(value, list):
        return [_ordered(v) for v in value]
    return value


def load_yaml(path: str | Path) -> dict[str, Any]:
    """An Experiment YAML file as a dict, parsed strictly into the typed models."""
    path = Path(path)
    try:  # bounded: size, depth, aliases expanded (llmft/trainer/yaml_limits.py)
        body = load_user_yaml(read_yaml_text(path, "Experiment YAML"), str(path))
    except ConfigError as exc:
        raise SweepError(str(exc)) from None
    if not isinstance(body, dict):
        raise SweepError(f"{path}: expected one YAML mapping (an Experiment), got {type(body).__name__}")
    parse_experiment(body)
    return body
