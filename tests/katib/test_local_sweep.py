"""The local sweep's machinery (samplers, search-space mapping, table, failure budget, MLflow) with a
stand-in trainer process; test_local_sweep_real.py runs the real trainer."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from pathlib import Path

import optuna
import pytest

from llmft.katib import search_space as ss
from llmft.katib.errors import ExperimentFailed, SweepError
from llmft.katib.experiment import SweepSpec, apply_overrides
from llmft.katib.local_sweep import grid_combinations, optuna_distributions, run_local_sweep
from llmft.trainer.mlflow_settings import PARENT_RUN_ENV

pytestmark = pytest.mark.slow  # every sweep starts its trials as processes

FAKE = Path(__file__).with_name("fake_trainer.py")


@pytest.fixture
def fake_python(tmp_path) -> str:
    """An executable that behaves like `python` for `-m llmft train` (runs fake_trainer.py)."""
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def expected_loss(overrides: list[str]) -> float:
    values = dict(o.split("=", 1) for o in overrides)
    return (math.log10(float(values["optim.lr"])) + 3.5) ** 2 + float(values.get("lora.r", "16")) / 100 + 0.1


def test_distributions_follow_katibs_optuna_service():
    spec = apply_overrides(
        SweepSpec(),
        [
            "space.lora_alpha.type=int",
            "space.lora_alpha.values=",
            "space.lora_alpha.min=8",
            "space.lora_alpha.max=64",
            "space.lora_alpha.step=8",
        ],
    )
    dists = optuna_distributions(ss.parameter_specs(spec.search_space, "tpe"))
    assert dists["learning_rate"] == optuna.distributions.FloatDistribution(1e-05, 0.001, log=True)
    assert dists["lora_r"] == optuna.distributions.CategoricalDistribution(["8", "16", "32", "64"])
    assert dists["lora_alpha"] == optuna.distributions.IntDistribution(8, 64, step=8)
    assert dists["lora_dropout"] == optuna.distributions.FloatDistribution(0.0, 0.1)


def test_grid_combinations_follow_katibs_convert_to_combinations():
    spec = apply_overrides(SweepSpec(algorithm="grid"), ["space.warmup_ratio=off"])
    combos = grid_combinations(ss.parameter_specs(spec.search_space, "grid"))
    assert combos["learning_rate"] == ["5e-05", "0.0001", "0.0002", "0.0005"]
    assert math.prod(len(v) for v in combos.values()) == 4 * 3 * 3 * 3
    double = ss.HyperParameter("x", "a.b", "double", min="0.0", max="0.1", step="0.03", grid=("0",))
    (spec_x,) = ss.parameter_specs((double,), "tpe")
    assert grid_combinations([spec_x])["x"] == pytest.approx([0.0, 0.03, 0.06, 0.09])  # np.arange semantics


def test_random_sweep_picks_the_lowest_eval_loss(tmp_path, fake_python, capsys):
    spec = apply_overrides(SweepSpec(algorithm="random"), ["space.lora_r.values=8,16,32"])
    result = run_local_sweep(
        spec, trials=5, trainer_args=["model.name_or_path=m", "data=d"], workdir=tmp_path, python=fake_python
    )
    assert [t.status for t in result.trials] == ["Succeeded"] * 5
    for trial in result.trials:  # eval_loss is the min over the three evals, as Katib's "min" strategy
        assert trial.metrics["eval_loss"] == pytest.approx(expected_loss(trial.overrides), abs=1e-5)
        assert [o.split("=")[0] for o in trial.overrides] == [
            "optim.lr",
            "lora.r",
            "lora.alpha",
            "lora.dropout",
            "schedule.warmup_ratio",
        ]
        assert (
            Path(trial.log_path)
            .read_text()
            .startswith(f"args resume=never model.name_or_path=m data=d output_dir={result.run_dir}/trial-")
        )
    best = min(result.trials, key=lambda t: t.metrics["eval_loss"])
    assert result.best is best
    table = result.table()
    assert table.splitlines()[0].split()[:4] == ["trial", "status", "eval_loss", "perplexity"]
    assert f"best: trial {best.number} eval_loss=" in table and best.overrides[0] in table


def test_trials_start_from_the_config_file(tmp_path, fake_python):
    """The HPO pipeline's local trials start from the plan's config.yaml: `--config` comes before the
    key=value items (argparse refuses an option after them)."""
    spec = apply_overrides(SweepSpec(algorithm="random", name="cfg"), [])
    result = run_local_sweep(
        spec, trials=1, trainer_args=["max_steps=3"], workdir=tmp_path, python=fake_python, config_path="/r/c.yaml"
    )
    log = next(Path(result.run_dir).glob("trial-000*.log")).read_text()
    assert (
        result.trials[0].status == "Succeeded" and "config /r/c.yaml" in log and "args resume=never max_steps=3" in log
    )


def test_every_sweep_gets_fresh_trial_folders(tmp_path, fake_python):
    spec = apply_overrides(SweepSpec(algorithm="random", name="again"), [])
    first = run_local_sweep(spec, trials=1, trainer_args=[], workdir=tmp_path, python=fake_python)
    second = run_local_sweep(spec, trials=1, trainer_args=[], workdir=tmp_path, python=fake_python)
    assert first.run_dir != second.run_dir and Path(first.run_dir).parent == Path(second.run_dir).parent == tmp_path
    assert Path(first.trials[0].log_path).is_file() and Path(second.trials[0].log_path).is_file()
    latest = json.loads((tmp_path / "trials.json").read_text())  # the latest sweep's record
    assert latest == json.loads((Path(second.run_dir) / "trials.json").read_text())
    assert latest[0]["log_path"] == second.trials[0].log_path and latest[0]["status"] == "Succeeded"


@pytest.mark.parametrize("algorithm", ["tpe", "bayesianoptimization"])
def test_model_based_samplers_run(tmp_path, fake_python, algorithm):
    spec = apply_overrides(SweepSpec(algorithm=algorithm, max_trials=3), ["space.lora_r.values=8,16"])
    result = run_local_sweep(spec, trials=3, trainer_args=[], workdir=tmp_path, python=fake_python)
    assert result.best is not None and len(result.trials) == 3


def test_grid_visits_every_combination_once(tmp_path, fake_python):
    spec = apply_overrides(
        SweepSpec(algorithm="grid"),
        [
            "space.learning_rate.grid=0.0001,0.001",
            "space.lora_r.grid=8,16",
            "space.lora_alpha=off",
            "space.lora_dropout=off",
            "space.warmup_ratio=off",
        ],
    )
    result = run_local_sweep(spec, trials=4, trainer_args=[], workdir=tmp_path, python=fake_python)
    assert sorted(tuple(t.overrides) for t in result.trials) == [
        ("optim.lr=0.0001", "lora.r=16"),
        ("optim.lr=0.0001", "lora.r=8"),
        ("optim.lr=0.001", "lora.r=16"),
        ("optim.lr=0.001", "lora.r=8"),
    ]
    with pytest.raises(SweepError, match="--trials 5 > the 4 grid combinations"):
        run_local_sweep(spec, trials=5, trainer_args=[], workdir=tmp_path, python=fake_python)


def test_failed_and_silent_trials_count_against_the_budget(tmp_path, fake_python, monkeypatch):
    spec = apply_overrides(SweepSpec(algorithm="random", max_failed_trials=0), ["space.lora_r.values=64"])
    with pytest.raises(ExperimentFailed, match=r"1 trials failed \(max_failed_trials=0\)") as err:
        run_local_sweep(spec, trials=3, trainer_args=[], workdir=tmp_path, python=fake_python)
    assert [t.status for t in err.value.state.trials] == ["Failed"]
    assert json.loads((tmp_path / "trials.json").read_text())[0]["status"] == "Failed"  # recorded anyway
    assert "CUDA out of memory" in Path(err.value.state.trials[0].log_path).read_text()  # stderr is captured too
    monkeypatch.setenv("FAKE_SILENT", "1")
    spec = apply_overrides(SweepSpec(algorithm="random", max_failed_trials=2), ["space.lora_r.values=8"])
    with pytest.raises(ExperimentFailed) as err:
        run_local_sweep(spec, trials=5, trainer_args=[], workdir=tmp_path, python=fake_python)
    assert [t.status for t in err.value.state.trials] == ["MetricsUnavailable"] * 3
    assert "no trial reported eval_loss" in err.value.state.table()


def test_mlflow_parent_run_and_trial_env(tmp_path, fake_python, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    spec = apply_overrides(SweepSpec(algorithm="random", name="mlf"), ["space.lora_r.values=8"])
    result = run_local_sweep(
        spec, trials=2, trainer_args=[], workdir=tmp_path / "w", python=fake_python, mlflow_experiment="sweeps-test"
    )
    assert result.parent_run_id
    for trial in result.trials:  # every trial's trainer was told its parent run
        assert f"parent_run={result.parent_run_id}" in Path(trial.log_path).read_text()
    run = MlflowClient(uri).get_run(result.parent_run_id)
    assert run.info.status == "FINISHED" and run.data.params["algorithm"] == "random"
    assert run.data.metrics["best_eval_loss"] == pytest.approx(result.best.metrics["eval_loss"])
    assert MlflowClient(uri).get_experiment(run.info.experiment_id).name == "sweeps-test"
    history = MlflowClient(uri).get_metric_history(run.info.run_id, "trial_eval_loss")
    assert sorted(m.step for m in history) == [0, 1]
    assert os.environ.get(PARENT_RUN_ENV) is None  # nothing leaks into this process
