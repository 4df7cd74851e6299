"""The promote step reports a decision (issue 44 item 2): a gate that says no is the output ``not promoted`` and the
reason, the step succeeds, nothing is copied; a checkpoint that cannot be promoted still fails the step, with one
``error:`` line; and SIGTERM during the copy leaves no hidden temporary folder (issue 45)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kfp import dsl
from plan_helpers import make_plan
from test_pipeline_promote_eval import evaluation, make_checkpoint

from llmft.components.lib.contracts.schema import write_plan
from llmft.components.promote import promote_best_checkpoint
from llmft.trainer.errors import EXIT_PREEMPTED, EXIT_USER_ERROR


def _artifacts(tmp_path: Path, result: dict):
    plan = make_plan(volume_path=str(tmp_path / "data"), mlflow_model_name="m", run_id="run-1")
    plan_artifact = dsl.Artifact(uri=str(tmp_path / "artifacts" / "plan"))
    write_plan(plan, plan_artifact.path)
    evaluated = dsl.Artifact(uri=str(tmp_path / "artifacts" / "evaluation"))
    os.makedirs(evaluated.path)
    Path(evaluated.path, "evaluation.json").write_text(json.dumps(result))
    return plan_artifact, evaluated, dsl.Model(uri=str(tmp_path / "artifacts" / "promoted"))


def test_a_refused_gate_is_the_decision_not_promoted_and_the_step_succeeds(tmp_path, capsys):
    run = tmp_path / "data" / "runs" / "run-1"
    make_checkpoint(run, 10)
    plan, evaluated, promoted = _artifacts(tmp_path, evaluation(50.0, 49.9, run_dir=run))  # 0.2% better: below 1%
    decision, reason = promote_best_checkpoint.python_func(plan=plan, evaluation=evaluated, promoted=promoted)
    assert decision == "not promoted" and "refusing to promote" in reason and "must be below" in reason
    recorded = json.loads(Path(promoted.path, "promotion.json").read_text())
    assert recorded["promoted"] is False and recorded["reason"] == reason
    assert promoted.metadata["decision"] == "not promoted" and promoted.metadata["path"] == ""
    assert not (tmp_path / "data" / "models" / "m" / "run-1").exists()  # nothing copied
    assert capsys.readouterr().out.strip().endswith(f"not promoted: {reason}")


def test_a_passing_gate_is_the_decision_promoted_with_the_copy(tmp_path):
    run = tmp_path / "data" / "runs" / "run-1"
    make_checkpoint(run, 10)
    plan, evaluated, promoted = _artifacts(tmp_path, evaluation(50.0, 20.0, run_dir=run))
    decision, _ = promote_best_checkpoint.python_func(plan=plan, evaluation=evaluated, promoted=promoted)
    assert decision == "promoted" and promoted.metadata["decision"] == "promoted"
    assert Path(promoted.metadata["path"], "adapter_model.safetensors").read_bytes() == b"weights-10"


def test_a_checkpoint_that_cannot_be_promoted_fails_the_step_with_one_line(tmp_path, capsys):
    run = tmp_path / "data" / "runs" / "run-1"
    make_checkpoint(run, 10, complete=False)  # the gate passes, the copy may not: a real failure, red
    plan, evaluated, promoted = _artifacts(tmp_path, evaluation(50.0, 20.0, run_dir=run))
    with pytest.raises(SystemExit) as stopped:
        promote_best_checkpoint.python_func(plan=plan, evaluation=evaluated, promoted=promoted)
    assert stopped.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "has no COMPLETE marker" in err


SLOW_COPY = textwrap.dedent(
    """
    import json, sys, time
    from kfp import dsl
    import llmft.components.lib.evaluation.promote as promote
    from llmft.components.promote import promote_best_checkpoint

    original = promote.copy_file

    def slow_copy(source, target, directory):
        original(source, target, directory)
        print(f"copied {source}", flush=True)
        time.sleep(30)  # a large adapter on a slow volume

    promote.copy_file = slow_copy
    root = sys.argv[1]
    promote_best_checkpoint.python_func(
        plan=dsl.Artifact(uri=f"{root}/artifacts/plan"),
        evaluation=dsl.Artifact(uri=f"{root}/artifacts/evaluation"),
        promoted=dsl.Model(uri=f"{root}/artifacts/promoted"),
    )
    """
)


@pytest.mark.slow
def test_sigterm_during_the_copy_exits_143_and_leaves_no_hidden_temporary_folder(tmp_path):
    """Issue 45: a SIGTERM while promote copied a 600 MB adapter left its hidden .<run>.*.tmp folder, removed only
    after 24 h (a retried pod on another host cannot tell its writer is gone). Now the copy stops, the folder goes."""
    run = tmp_path / "data" / "runs" / "run-1"
    make_checkpoint(run, 10)
    _artifacts(tmp_path, evaluation(50.0, 20.0, run_dir=run))
    (tmp_path / "slow_copy.py").write_text(SLOW_COPY)
    step = subprocess.Popen(
        [sys.executable, str(tmp_path / "slow_copy.py"), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    models = tmp_path / "data" / "models" / "m"
    try:
        assert step.stdout.readline().startswith("copied "), step.stderr.read()[-2000:]
        assert [p.name for p in models.glob(".run-1.*.tmp")], "the copy is under way in a temporary folder"
        started = time.monotonic()
        step.send_signal(signal.SIGTERM)
        _, err = step.communicate(timeout=60)
    finally:
        step.kill()
    assert step.returncode == EXIT_PREEMPTED and time.monotonic() - started < 20
    assert err.strip().splitlines()[-1].startswith("error: promote-best-checkpoint: stopped by SIGTERM")
    assert "Traceback" not in err
    assert list(models.iterdir()) == [], "no temporary folder, no half promotion"
