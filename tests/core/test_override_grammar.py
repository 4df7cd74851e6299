"""Overrides are split once, by the one grammar (``split_assignment``), and every launcher builds the trainer's
command line with the same function (llmft/trainer/command_line.py; issue 38.4)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmft.trainer.command_line import format_overrides, override_pairs, train_arguments
from llmft.trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
HAND_SPLIT = re.compile(r"""\.split\(\s*["']=["']\s*,\s*1\s*\)""")
NOT_OVERRIDES = {
    # vLLM / KServe command-line flags (--lora-modules name=path, --model_name=x), not trainer overrides
    "llmft/components/lib/serving/inferenceservice.py",
    # the trainer's own log line "[trainer_entry] loaded=<seconds>", not an override
    "llmft/benchmarks/gpu/arm_project.py",
}


def test_no_module_splits_an_override_by_hand():
    found = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "llmft").rglob("*.py")
        if HAND_SPLIT.search(path.read_text(encoding="utf-8"))
    )
    assert set(found) <= NOT_OVERRIDES, f"split key=value with override_pairs / split_assignment: {found}"


def test_pairs_keep_an_equals_sign_in_the_value_and_strip_the_key():
    assert override_pairs([" observe.run_name =a=b", "data=", "lora.r=8"]) == [
        ("observe.run_name", "a=b"),
        ("data", ""),
        ("lora.r", "8"),
    ]
    with pytest.raises(ConfigError, match="`max_steps`: expected key=value"):
        override_pairs(["max_steps"])


def test_the_command_line_round_trips_through_the_grammar():
    pairs = [("lora.target_modules", ["q_proj", "v_proj"]), ("eval.enabled", False), ("x", None), ("a", "b=c")]
    args = train_arguments(nproc="2", config_path="/runs/r/config.yaml", overrides=pairs)
    assert args == [
        "train", "--nproc", "2", "--config", "/runs/r/config.yaml",
        "lora.target_modules=[q_proj,v_proj]", "eval.enabled=false", "x=null", "a=b=c",
    ]  # fmt: skip
    assert override_pairs(args[5:]) == [
        ("lora.target_modules", "[q_proj,v_proj]"),
        ("eval.enabled", "false"),
        ("x", "null"),
        ("a", "b=c"),
    ]
    assert train_arguments(overrides=[("resume", "never")]) == ["train", "resume=never"]
    assert format_overrides([]) == []


def test_a_trial_override_without_equals_sign_is_refused_not_ignored():
    """The sweep's clash check read ``o.split("=", 1)[0]``: a bare word passed it and failed later in every trial."""
    from llmft.components.lib.jobs.katib_sweep import check_trial_overrides
    from llmft.katib.experiment import SweepSpec

    with pytest.raises(ConfigError, match="`max_steps`: expected key=value"):
        check_trial_overrides(SweepSpec(name="s"), ["max_steps"])
    with pytest.raises(ConfigError, match="set keys the sweep sets itself"):
        check_trial_overrides(SweepSpec(name="s"), [" data =x"])
