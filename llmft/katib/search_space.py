"""The hyperparameter search space, keyed by the trainer's dotted config names.

One search space feeds both the Katib Experiment (``spec.parameters``, through
:func:`parameter_specs`) and the local sweep (Optuna distributions built from
those same ``V1beta1ParameterSpec`` models, see ``llmft/katib/local_sweep.py``), so
the cluster and the laptop search the same space.

Each :class:`HyperParameter` is one Katib parameter (``name``) bound to one
trainer override (``config_key``): the trial command carries
``<config_key>=${trialParameters.<name>}``.

The grid algorithm needs a finite set per parameter (Katib's grid service
rejects a double without a step), so each parameter also lists the ``grid``
values it takes there; every other algorithm searches the continuous range or
the ``values`` list.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmft.katib.errors import SweepError
from llmft.trainer.config import SearchRange, iter_settings

if TYPE_CHECKING:
    from kubeflow_katib_api.models import V1beta1ParameterSpec

PARAMETER_TYPES = ("double", "int", "discrete", "categorical")
DISTRIBUTIONS = ("uniform", "logUniform", "normal", "logNormal")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class HyperParameter:
    """One searched hyperparameter and the trainer override it sets."""

    name: str
    """Katib parameter and trial-parameter name (lower snake case, e.g. ``learning_rate``)."""
    config_key: str
    """Dotted trainer config key the value is passed to, e.g. ``optim.lr``."""
    type: str
    """Katib parameterType: double, int (ranges) or discrete, categorical (lists)."""
    min: str | None = None
    """Lower bound (double/int), a string as in Katib's feasibleSpace."""
    max: str | None = None
    """Upper bound (double/int)."""
    step: str | None = None
    """Optional quantization step (double/int)."""
    distribution: str | None = None
    """Sampling distribution for ranges: uniform or logUniform (Katib also knows normal, logNormal)."""
    values: tuple[str, ...] = ()
    """Feasible list for discrete/categorical parameters."""
    grid: tuple[str, ...] = ()
    """Finite values the grid algorithm enumerates (discrete list in grid Experiments)."""
    description: str = ""
    """One line for the trial parameter's description."""

    def check(self) -> None:
        """Raise :class:`SweepError` naming the field when this parameter cannot be searched."""
        where = f"search space parameter {self.name!r}"
        if not _NAME_RE.match(self.name):
            raise SweepError(
                f"{where}: name must match {_NAME_RE.pattern} (it becomes ${{trialParameters.{self.name}}})"
            )
        if self.type not in PARAMETER_TYPES:
            raise SweepError(f"{where}: type {self.type!r} is not one of {', '.join(PARAMETER_TYPES)}")
        if self.type in ("double", "int"):
            self._check_range(where)
        else:
            if not self.values:
                raise SweepError(f"{where}: a {self.type} parameter needs a non-empty values list")
            stray = [k for k in ("min", "max", "step", "distribution") if getattr(self, k) is not None]
            if stray:
                raise SweepError(
                    f"{where}: {', '.join(stray)} do not apply to a {self.type} parameter; "
                    "set values=... (or change type=double/int)"
                )
        if not self.grid:
            raise SweepError(f"{where}: list the grid values the grid algorithm should try (grid=...)")

    def _check_range(self, where: str) -> None:
        try:
            low, high = float(self.min), float(self.max)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise SweepError(f"{where}: min and max must be numbers, got min={self.min!r} max={self.max!r}") from None
        if not low < high:
            raise SweepError(f"{where}: empty range, min {self.min} must be below max {self.max}")
        if self.distribution not in (None, *DISTRIBUTIONS):
            raise SweepError(f"{where}: distribution {self.distribution!r} is not one of {', '.join(DISTRIBUTIONS)}")
        if self.distribution == "logUniform" and low <= 0:
            raise SweepError(f"{where}: a logUniform range needs min > 0, got {self.min}")
        if self.type == "int" and not (float(low).is_integer() and float(high).is_integer()):
            raise SweepError(f"{where}: an int parameter needs integer bounds, got {self.min}..{self.max}")

    def placeholder(self) -> str:
        """The text Katib replaces with this trial's value."""
        return trial_placeholder(self.name)

    def override(self) -> str:
        """The trainer argument of the trial command: ``<config_key>=${trialParameters.<name>}``."""
        return f"{self.config_key}={self.placeholder()}"


def trial_placeholder(name: str) -> str:
    """``${trialParameters.<name>}`` (Katib's TrialTemplateParamReplaceFormat)."""
    return "${trialParameters." + name + "}"


def default_search_space() -> tuple[HyperParameter, ...]:
    """The space of every trainer field that declares a default search range (llmft/trainer/config.py: a
    ``Setting`` with ``search=SearchRange(...)``), ordered by their ranks: the field declares its name,
    trainer key and range once, here they only become Katib parameters."""
    ranged = [(key, s.name, s.search) for key, s in iter_settings() if s.search is not None]
    return tuple(
        HyperParameter(name=name, config_key=key, **_search_fields(search))
        for key, name, search in sorted(ranged, key=lambda row: row[2].rank)
    )


def _search_fields(search: SearchRange) -> dict[str, Any]:
    return {f.name: getattr(search, f.name) for f in dataclasses.fields(search) if f.name != "rank"}


# The default space for LoRA fine-tuning, declared on the trainer's fields. Ranges are the usual ones for
# 0.5B-30B decoder models; the grid keeps 3-4 points per axis (4*3*3*3*3 = 324 combinations).
DEFAULT_SEARCH_SPACE: tuple[HyperParameter, ...] = default_search_space()


def check_space(space: tuple[HyperParameter, ...]) -> None:
    """Every parameter valid, names and config keys unique."""
    if not space:
        raise SweepError("the search space is empty: list at least one hyperparameter")
    for param in space:
        param.check()
    for attr in ("name", "config_key"):
        seen = [getattr(p, attr) for p in space]
        dupes = sorted({x for x in seen if seen.count(x) > 1})
        if dupes:
            raise SweepError(f"search space: duplicate {attr} {', '.join(dupes)}")


def parameter_specs(space: tuple[HyperParameter, ...], algorithm: str) -> list[V1beta1ParameterSpec]:
    """``spec.parameters`` of the Experiment for ``algorithm`` (grid uses each parameter's grid list)."""
    check_space(space)
    return [_parameter_spec(p, algorithm) for p in space]


def _parameter_spec(param: HyperParameter, algorithm: str) -> V1beta1ParameterSpec:
    # heavy: kubeflow_katib_api, pydantic
    from kubeflow_katib_api.models import V1beta1FeasibleSpace, V1beta1ParameterSpec

    if algorithm == "grid":
        numeric = all(_is_number(v) for v in param.grid)
        return V1beta1ParameterSpec(
            name=param.name,
            parameterType="discrete" if numeric else "categorical",
            feasibleSpace=V1beta1FeasibleSpace(list=list(param.grid)),
        )
    if param.type in ("discrete", "categorical"):
        space = V1beta1FeasibleSpace(list=list(param.values))
    else:
        space = V1beta1FeasibleSpace(min=param.min, max=param.max, step=param.step, distribution=param.distribution)
    return V1beta1ParameterSpec(name=param.name, parameterType=param.type, feasibleSpace=space)


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def with_override(space: tuple[HyperParameter, ...], dotted: str, value: str) -> tuple[HyperParameter, ...]:
    """Apply ``space.<name>.<field>=<value>`` (lists comma-separated; ``space.<name>=off`` drops it)."""
    name, _, field = dotted.partition(".")
    if not any(p.name == name for p in space):
        known = ", ".join(p.name for p in space)
        raise SweepError(f"space.{dotted}: no searched parameter {name!r} (known: {known})")
    if not field:
        if value.lower() not in ("off", "none", "false"):
            raise SweepError(f"space.{name}={value}: only `off` can be given without a field (drops the parameter)")
        return tuple(p for p in space if p.name != name)
    fields = {f.name for f in dataclasses.fields(HyperParameter)} - {"name"}
    if field not in fields:
        raise SweepError(f"space.{dotted}: unknown field {field!r}; use one of {', '.join(sorted(fields))}")
    parsed: Any = tuple(v.strip() for v in value.split(",") if v.strip()) if field in ("values", "grid") else value
    if field in ("min", "max", "step", "distribution") and value.lower() in ("", "none", "null"):
        parsed = None
    # Not checked here: a type change takes several overrides; the caller checks the final space.
    return tuple(dataclasses.replace(p, **{field: parsed}) if p.name == name else p for p in space)
