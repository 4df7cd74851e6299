"""plan.json's schema version follows its layout (issue 43 item 6).

Every step reads the plan the plan step wrote (lib/contracts/schema.py ``read_plan``). The reader fills a field the
file lacks with its default and drops a field it does not know, so a plan of another layout is not refused but
misread: a version-2 plan (before the evaluation's resolved specs) read by today's evaluate step ran none of its
tasks, and today's plan read by a version-2 promote step promoted without its guard tasks. Plans of two layouts
meet when a step's image differs from the plan step's (a mutable image tag under KFP's cache, an image override).
The version number is the only thing that turns that into the one-line refusal ``read_plan`` gives; these tests
hold it to the layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing

import pytest
from plan_helpers import make_plan

from llmft.components.lib.contracts.schema import PLAN_SCHEMA_VERSION, RunPlan, write_plan
from llmft.trainer.config import TrainConfig
from llmft.trainer.errors import ConfigError

LAYOUTS = {3: "db64217c541c7b4f", 4: "9621fb95c3211b0e"}  # 4: the data plan's hub config and column mapping
"""sha256 (first 16 hex digits) of plan.json's layout (:func:`layout`) for each schema version. When this test
goes red, plan.json's layout changed: bump PLAN_SCHEMA_VERSION in llmft/components/lib/contracts/schema.py and add the
new version's line here (a field the old readers would drop or default is a misread, not a refusal)."""


def layout(tp: typing.Any = RunPlan, prefix: str = "") -> list[str]:
    """Every field path of the plan's dataclasses with its type, e.g. ``evaluation.guards[].metric: str``.
    TrainConfig is one opaque field: its own reader (config_from_dict) refuses what it does not know."""
    if tp is TrainConfig:
        return [f"{prefix}: TrainConfig"]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        paths = []
        for f in dataclasses.fields(tp):
            paths += layout(hints[f.name], f"{prefix}.{f.name}" if prefix else f.name)
        return paths
    if origin is tuple or origin is dict:
        return layout(args[-1 if origin is dict else 0], f"{prefix}[]")
    if args and type(None) in args:
        return layout(next(a for a in args if a is not type(None)), f"{prefix}?")
    return [f"{prefix}: {getattr(tp, '__name__', str(tp))}"]


def test_the_schema_version_changes_with_the_layout():
    digest = hashlib.sha256("\n".join(layout()).encode()).hexdigest()[:16]
    assert LAYOUTS.get(PLAN_SCHEMA_VERSION) == digest, (
        f"plan.json's layout is now {digest}, recorded for version {PLAN_SCHEMA_VERSION} as "
        f"{LAYOUTS.get(PLAN_SCHEMA_VERSION)}: bump PLAN_SCHEMA_VERSION and record the new layout in LAYOUTS"
    )


def test_a_plan_of_the_layout_before_the_evaluation_specs_is_refused_not_misread(tmp_path):
    """A plan as version 2 wrote it (evaluation: tasks, questions, max_questions only; no registry.enabled): read
    as today's it would have specs () and run no task at all; it is refused in one line instead."""
    plan = make_plan(promote_eval_tasks="heldout")
    assert plan.evaluation.specs  # today's plan: the task resolved by the plan step
    data = json.loads(plan.to_json())
    data["schema_version"] = 2
    data["evaluation"] = {k: data["evaluation"][k] for k in ("tasks", "questions", "max_questions")}
    del data["registry"]["enabled"]
    with pytest.raises(ConfigError) as refused:
        RunPlan.from_json(json.dumps(data))
    message = str(refused.value)
    assert f"plan.json has schema version 2, this code reads {PLAN_SCHEMA_VERSION}" in message
    assert "re-run the pipeline with one image version" in message and "\n" not in message
    write_plan(plan, tmp_path)
    assert RunPlan.from_json((tmp_path / "plan.json").read_text()) == plan  # today's own plan reads back
