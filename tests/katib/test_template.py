"""katib/experiment_template.yaml (what a user edits) is the builder's output (the same object)."""

from __future__ import annotations

from pathlib import Path

import yaml

from llmft.cli import main as llmft_main
from llmft.commands.sweep import TEMPLATE_ARGS, build_from_settings
from llmft.components import images
from llmft.katib.experiment import experiment_dict, parse_experiment
from llmft.katib.experiment_yaml import load_yaml
from llmft.katib.webhook_rules import validate_experiment

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "katib" / "experiment_template.yaml"  # the checkout's katib/
# The default image, whatever LLMFT_TRAINER_IMAGE says in this environment.
DEFAULT_IMAGE = f"{images.IMAGE_REGISTRY}/llmft-trainer:{images.IMAGE_TAG}"


def test_template_equals_builder_output():
    built = experiment_dict(build_from_settings([*TEMPLATE_ARGS, f"image={DEFAULT_IMAGE}"]))
    template = yaml.safe_load(TEMPLATE_PATH.read_text())
    assert template == built, (
        "katib/experiment_template.yaml is stale: regenerate with `llmft sweep create "
        "--dry-run --output ...` and carry its comments over"
    )


def test_template_parses_and_passes_katib_rules():
    body = load_yaml(TEMPLATE_PATH)  # strict parse into the katib-api models
    assert parse_experiment(body).spec.trial_template.primary_container_name == "pytorch"
    assert validate_experiment(body) == []


def test_edited_template_goes_through_create(tmp_path, capsys):
    edited = TEMPLATE_PATH.read_text().replace("maxTrialCount: 12", "maxTrialCount: 2")
    path = tmp_path / "edited.yaml"
    path.write_text(edited)
    assert llmft_main(["sweep", "create", "--from-yaml", str(path), "--dry-run"]) == 1
    assert "spec.parallelTrialCount: 3 should be <= spec.maxTrialCount 2" in capsys.readouterr().err
    path.write_text(
        edited.replace("parallelTrialCount: 3", "parallelTrialCount: 2").replace(
            "maxFailedTrialCount: 3", "maxFailedTrialCount: 1"
        )
    )
    assert llmft_main(["sweep", "create", "--from-yaml", str(path), "--dry-run"]) == 0
    assert "maxTrialCount: 2" in capsys.readouterr().out
