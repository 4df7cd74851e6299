"""The forms of the pipeline, and the parameters' older names: what derives from the declarations in
llmft/components/lib/plan/parameters.py besides the typed value.

A :class:`Form` says which declared parameters one compiled pipeline offers as run parameters (the KFP UI's
fields); the others are compiled in, as constants of the plan step. :data:`GROUPS` names the prefixes that
sort a form's fields into the order a run is set up in (the KFP UI sorts them by name). :func:`renamed` and
:func:`form_parameter` let the commands and functions take a parameter's older name, with a note.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmft.components.lib.plan.parameters import BY_NAME, OLD_NAMES, PARAMETERS, Parameter, unknown_name
from llmft.trainer.errors import ConfigError

PIPELINE_NAME = "llm-finetune"

GROUPS: tuple[tuple[str, str], ...] = (
    ("base_", "The base model"),
    ("dataset", "The data"),
    ("finetune_", "How it fine-tunes"),
    ("hpo_", "The sweep of the HPO pipeline"),
    ("mlflow_", "MLflow: where runs are tracked and registered"),
    ("promote_", "Evaluation and the promotion gate"),
    ("serving_", "Serving with KServe and vLLM"),
    ("step_", "The pipeline steps' own pods"),
    ("training_", "The training job: a PyTorchJob or a TrainJob"),
    ("volume_", "The data volume"),
)
"""Name prefix -> title of each group of run parameters, in the order the KFP UI's sorted form shows them."""


def group_of(name: str) -> str:
    """The prefix of the group ``name`` belongs to ('' for none: the compile-time parameters)."""
    return next((prefix for prefix, _ in GROUPS if name.startswith(prefix)), "")


@dataclass(frozen=True)
class Form:
    """Which parameters one compiled pipeline offers as run parameters (the others are compiled in as constants).

    ``hpo``: the sweep pipeline (its ``hpo`` parameters too); ``minimal``: only the parameters declared
    ``minimal``; ``local``: the form kfp.local runs (``llmft pipeline run-local``), which also offers the
    ``local`` ones. A ``compile`` parameter is never offered."""

    hpo: bool = False
    minimal: bool = False
    local: bool = False

    @property
    def pipeline_name(self) -> str:
        return PIPELINE_NAME + ("-hpo" if self.hpo else "") + ("-minimal" if self.minimal else "")

    def has(self, parameter: Parameter) -> bool:
        """Whether the plan of this pipeline reads the parameter at all (the HPO ones only in the HPO pipeline)."""
        return self.hpo or not parameter.declared.hpo

    def offers(self, parameter: Parameter) -> bool:
        """Whether the parameter is a run parameter (a field of the KFP UI's form) of this pipeline."""
        offer = parameter.declared.offer
        if not self.has(parameter) or offer == "compile" or (offer == "local" and not self.local):
            return False
        return parameter.declared.minimal or not self.minimal

    def offered(self) -> tuple[Parameter, ...]:
        return tuple(p for p in PARAMETERS if self.offers(p))

    def description(self, parameter: Parameter) -> str:
        """The parameter's description in this form (values only kfp.local accepts are named in the local form)."""
        text = parameter.declared.description
        if self.local and parameter.declared.local_values:
            text += f" Under kfp.local also: {parameter.declared.local_values}."
        return text


class RenamedParameterWarning(FutureWarning):
    """A pipeline parameter was given under its older name (it still works; the note names the new one)."""


def renamed(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each older parameter name replaced by the parameter's name (a RenamedParameterWarning
    each); ConfigError when one parameter is given under both names."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        new = OLD_NAMES.get(name, name)
        if new != name and new in values:
            raise ConfigError(f"pipeline parameter `{new}` is given twice: `{name}` is its old name; keep `{new}`")
        if new != name:
            warnings.warn(rename_note(name), RenamedParameterWarning, stacklevel=2)
        out[new] = value
    return out


def rename_note(old: str) -> str:
    return f"pipeline parameter `{old}` is now `{OLD_NAMES[old]}` (the old name still works)"


def form_parameter(name: str, form: Form) -> Parameter:
    """The parameter ``name`` of the pipeline of ``form`` (a run parameter, or one compiled in), or ConfigError
    in one line saying why it is none: unknown (with the closest name), the HPO pipeline's, or kfp.local's."""
    parameter = BY_NAME.get(OLD_NAMES.get(name, name))
    if parameter is None:
        raise ConfigError(unknown_name(name))
    if not form.has(parameter):
        raise ConfigError(f"pipeline parameter `{parameter.name}` belongs to the HPO pipeline: add --hpo")
    if parameter.declared.offer == "local" and not form.local:
        raise ConfigError(
            f"pipeline parameter `{parameter.name}` is a kfp.local setting (llmft pipeline run-local); on a cluster "
            f"the pipeline uses {parameter.default!r}"
        )
    return parameter
