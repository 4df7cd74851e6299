"""A pipeline parameter the plan step let through and a later step refused (issue 45's probe): the plan refuses
it in seconds, before any step runs (docs/failure-modes.md has a row per test)."""

from __future__ import annotations

import pytest
from plan_helpers import make_plan

from llmft.trainer.errors import ConfigError


@pytest.mark.parametrize("value", ["yaml", "openai", "Messages"])
def test_the_plan_refuses_a_dataset_format_prepare_would_refuse(value):
    with pytest.raises(ConfigError, match=rf"pipeline parameter `dataset_format`='{value}': use one of auto, messages"):
        make_plan(dataset_format=value)
    assert make_plan(dataset_format="sharegpt").data.format == "sharegpt"
