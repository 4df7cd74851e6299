"""One record per step (lib/plan/steps.py, issue 48 item 4): the pipeline builder applies it to each task and
the plan's Secret preflight reads which Secrets the tasks mount from it."""

from __future__ import annotations

import dataclasses

import pytest
from plan_helpers import make_plan

from llmft.components.lib.plan import steps
from llmft.pipelines.llm_finetune import TASK_ORDER, build_pipeline
from llmft.pipelines.llm_finetune_hpo import TASK_ORDER as HPO_TASK_ORDER
from llmft.trainer.errors import ConfigError


def test_every_task_of_the_body_has_one_record_in_running_order():
    promoted_run = [step for step in steps.STEPS if step.branch != steps.NOT_PROMOTED]
    assert HPO_TASK_ORDER == tuple(step.task for step in promoted_run)
    assert TASK_ORDER == tuple(step.task for step in promoted_run if not step.hpo_only)
    assert [step.task for step in steps.STEPS if step.branch == steps.NOT_PROMOTED] == ["summarize-not-promoted"]
    assert len(steps.STEP) == len(steps.STEPS)
    assert {step.resources for step in steps.STEPS} <= set(steps.RESOURCE_PARAMETERS)
    assert {step.image for step in steps.STEPS} <= set(steps.IMAGE_ROLES)


def test_the_builder_refuses_a_component_that_runs_on_another_image_than_its_record(monkeypatch):
    wrong = dataclasses.replace(steps.STEP["evaluate-perplexity"], image="pipeline")
    monkeypatch.setitem(steps.STEP, "evaluate-perplexity", wrong)
    with pytest.raises(ConfigError, match="step evaluate-perplexity: its component runs on .*llmft-trainer"):
        build_pipeline()


def _secret_kinds(plan) -> list[str]:
    return [secret.kind for secret in plan.task_secrets]


def test_the_secret_preflight_checks_what_the_records_mount(monkeypatch):
    named = {"hf_token_secret": "hf", "mlflow_secret": "ml", "langfuse_secret": "lf"}
    assert _secret_kinds(make_plan(**named)) == ["hf", "mlflow", "langfuse"]
    no_langfuse = tuple(
        dataclasses.replace(s, secrets=tuple(k for k in s.secrets if k != "langfuse")) for s in steps.STEPS
    )
    monkeypatch.setattr(steps, "STEPS", no_langfuse)
    assert _secret_kinds(make_plan(**named)) == ["hf", "mlflow"]
