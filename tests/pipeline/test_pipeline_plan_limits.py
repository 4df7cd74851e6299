"""Issue 27 item 6, plan step: a too-long mlflow_model_name and model.trust_remote_code=true are refused
by the plan step (seconds, before any GPU), not found out later. Before the fix a 300-character name was
accepted, then failed in promote with "File name too long" and was retried as a transient fault; and
finetune_overrides=model.trust_remote_code=true was passed on to the training pods silently."""

from __future__ import annotations

import pytest
from plan_helpers import RUN_ID, make_plan, parameters

from llmft.components.lib.contracts.volume_paths import NAME_MAX
from llmft.components.lib.plan.build import build_plan
from llmft.components.lib.plan.checks import REMOTE_CODE_ENV, compiled_settings
from llmft.trainer.errors import ConfigError


def test_a_model_name_longer_than_a_file_name_is_refused_by_the_plan(tmp_path):
    with pytest.raises(ConfigError, match=rf"mlflow_model_name is 300 characters long .*at most {NAME_MAX}"):
        make_plan(mlflow_model_name="m" * 300)
    assert make_plan(mlflow_model_name="m" * NAME_MAX).registry.model_name == "m" * NAME_MAX
    (tmp_path / ("m" * NAME_MAX)).mkdir()  # the limit is the file system's: NAME_MAX characters is a folder


def _plan(environ: dict, hpo: bool = False, **changes):
    values = parameters(**changes)
    pipeline = "llm-finetune-hpo" if hpo else "llm-finetune"
    return build_plan(values, run_id=RUN_ID, compiled=compiled_settings(pipeline, values, environ), environ={})


@pytest.mark.parametrize(
    "changes",
    [
        {"finetune_overrides": "save_every=50 model.trust_remote_code=true"},
        {"hpo_trial_overrides": "max_steps=20 model.trust_remote_code=True"},
    ],
    ids=["finetune_overrides", "hpo_trial_overrides"],
)
def test_trust_remote_code_is_refused_unless_the_pipeline_was_compiled_to_allow_it(capsys, changes):
    hpo = "hpo_trial_overrides" in changes
    with pytest.raises(ConfigError, match=f"model.trust_remote_code=true runs code .*{REMOTE_CODE_ENV}=1"):
        _plan({}, hpo=hpo, **changes)
    plan = _plan({REMOTE_CODE_ENV: "1"}, hpo=hpo, **changes)
    assert plan.run_id == RUN_ID
    assert "WARNING: model.trust_remote_code=true: the training pods will RUN PYTHON CODE" in capsys.readouterr().out
    _plan({})  # without it nothing changes, and nothing is announced
    assert "trust_remote_code" not in capsys.readouterr().out
