"""A local sweep of 3 trials running the REAL trainer on the tiny model: the collector's filter
reads the trainer's stdout, the best trial is the lowest eval loss, and with MLflow configured
every trial's run is a child of the sweep's parent run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmft.katib.experiment import SweepSpec, apply_overrides
from llmft.katib.local_sweep import run_local_sweep
from llmft.katib.metrics import parse_metric_lines

pytestmark = pytest.mark.slow

TRIAL_ARGS = [
    "max_steps=4",
    "eval_every=2",
    "log_every=2",
    "batch.global_sequences=2",
    "eval.max_sequences=8",
    "observe.progress_bar=false",
    "observe.tensorboard=false",
]


@pytest.fixture(scope="module")
def real_sweep(tiny_model_dir, tmp_path_factory):
    import os

    from llmft.commands.sweep import local_inputs

    work = tmp_path_factory.mktemp("sweep")
    model, data = local_inputs(work, str(tiny_model_dir), None)  # prepares + tokenizes the shipped sample
    uri = f"sqlite:///{work / 'mlflow.db'}"
    spec = apply_overrides(SweepSpec(name="real", algorithm="random", seed=7), [])
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        result = run_local_sweep(
            spec,
            trials=3,
            trainer_args=[f"model.name_or_path={model}", f"data={data}", *TRIAL_ARGS],
            workdir=work / "trials",
            mlflow_experiment="sweep-test",
            timeout_s=600,
        )
    finally:
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI")
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return result, work, uri


def _trial_dir(trial) -> Path:
    return Path(trial.log_path).with_suffix("")


def test_three_trials_finish_and_the_lowest_eval_loss_wins(real_sweep):
    result, _, _ = real_sweep
    assert [t.status for t in result.trials] == ["Succeeded"] * 3
    losses = [t.metrics["eval_loss"] for t in result.trials]
    assert len(set(losses)) == 3  # the hyperparameters made a difference
    assert result.best is result.trials[losses.index(min(losses))]
    assert result.table().splitlines()[-6].startswith(f"best: trial {result.best.number} eval_loss=")


def test_the_filter_parses_the_real_trainer_stdout(real_sweep):
    result, _, _ = real_sweep
    for trial in result.trials:
        stdout = Path(trial.log_path).read_text()
        evals = [
            json.loads(line)
            for line in (_trial_dir(trial) / "metrics.jsonl").read_text().splitlines()
            if '"eval"' in line
        ]
        parsed = parse_metric_lines(stdout, ["eval_loss", "perplexity"])
        # one eval_loss and one perplexity per evaluation the trainer recorded, same values, same order
        assert [v for n, v in parsed if n == "eval_loss"] == pytest.approx([e["eval_loss"] for e in evals], abs=1e-6)
        assert [v for n, v in parsed if n == "perplexity"] == pytest.approx([e["perplexity"] for e in evals], rel=1e-6)
        assert len(evals) == 2
        manifest = json.loads((_trial_dir(trial) / "final" / "training_manifest.json").read_text())
        assert trial.metrics["eval_loss"] == pytest.approx(manifest["best"]["eval_loss"], abs=1e-6)


def test_each_trial_ran_with_its_own_hyperparameters(real_sweep):
    result, _, _ = real_sweep
    for trial in result.trials:
        config = json.loads((_trial_dir(trial) / "final" / "training_manifest.json").read_text())["config"]
        assigned = dict(o.split("=", 1) for o in trial.overrides)
        assert config["optim"]["lr"] == pytest.approx(float(assigned["optim.lr"]))
        assert config["lora"]["r"] == int(assigned["lora.r"])
        assert config["lora"]["alpha"] == float(assigned["lora.alpha"])
        assert config["schedule"]["warmup_ratio"] == pytest.approx(float(assigned["schedule.warmup_ratio"]))


def test_trials_are_mlflow_children_of_the_sweep_run(real_sweep):
    from mlflow.tracking import MlflowClient

    result, _, uri = real_sweep
    client = MlflowClient(uri)
    parent = client.get_run(result.parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'"
    )
    manifests = [json.loads((_trial_dir(t) / "final" / "training_manifest.json").read_text()) for t in result.trials]
    assert sorted(r.info.run_id for r in children) == sorted(m["mlflow_run_id"] for m in manifests)
    assert parent.data.metrics["best_eval_loss"] == pytest.approx(result.best.metrics["eval_loss"])
