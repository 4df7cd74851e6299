"""The metric lines the trainer prints and Katib's StdOut collector parses.

One regular expression, used in two places: as ``spec.metricsCollectorSpec.source.
filter.metricsFormat`` of the Experiment (compiled by Katib's Go collector, RE2)
and by :func:`parse_metric_lines` here (Python ``re``), which the local sweep and
the tests use. The expression is written in the common subset of RE2 and Python
``re`` with ASCII-only classes, so both engines match the same text.

:func:`parse_metric_lines` mirrors ``parseLogsInTextFormat`` of Katib's
file-metricscollector (v0.19): skip lines that contain no metric name, find all
matches per line, group 1 (stripped) is the name, group 2 (stripped) the value,
keep names equal to a requested metric.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

# name: letters, digits, '_', '.', '-' (greedy and leftmost, so `train_eval_loss=`
# is read as the name `train_eval_loss`, never as `eval_loss`);
# value: a decimal float with optional exponent (never empty: `eval_loss=nan` is not a value).
METRICS_FILTER = r"([A-Za-z0-9_.-]+)[ \t]*=[ \t]*([+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)"
_FILTER_RE = re.compile(METRICS_FILTER)

OBJECTIVE_METRIC = "eval_loss"
ADDITIONAL_METRICS: tuple[str, ...] = ("perplexity",)

# Katib metric strategies (spec.objective.metricStrategies[].value).
STRATEGIES = ("min", "max", "latest")


def parse_metric_lines(
    text: str | Iterable[str], metric_names: Sequence[str], metrics_format: str = METRICS_FILTER
) -> list[tuple[str, float]]:
    """All ``(name, value)`` observations of ``metric_names`` in ``text``, in order."""
    lines = text.splitlines() if isinstance(text, str) else text
    pattern = _FILTER_RE if metrics_format == METRICS_FILTER else re.compile(metrics_format)
    observations: list[tuple[str, float]] = []
    for line in lines:
        if not any(name in line for name in metric_names):
            continue
        for match in pattern.finditer(line):
            name, value = match.group(1).strip(), match.group(2).strip()
            if name in metric_names:
                observations.append((name, float(value)))
    return observations


def reduce_metric(values: Sequence[float], strategy: str) -> float | None:
    """One value per metric the way Katib extracts it (min, max or latest); None when unreported."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    if strategy == "min":
        return min(finite)
    if strategy == "max":
        return max(finite)
    if strategy == "latest":
        return finite[-1]
    raise ValueError(f"unknown metric strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")


def summarize(observations: Sequence[tuple[str, float]], strategies: dict[str, str]) -> dict[str, float]:
    """``{metric: value}`` reduced with each metric's strategy (metrics never reported are left out)."""
    summary: dict[str, float] = {}
    for name, strategy in strategies.items():
        value = reduce_metric([v for n, v in observations if n == name], strategy)
        if value is not None:
            summary[name] = value
    return summary
