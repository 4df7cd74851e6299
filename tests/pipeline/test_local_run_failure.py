"""How `llmft pipeline run-local` shows a failed task (issue 35, Low): one `error:` line on stderr naming the
task and its own error; the screen's tail without the Python traceback kfp's executor printed."""

from __future__ import annotations

from pathlib import Path

from llmft.cli import main as llmft_main
from llmft.pipelines.local_run import LocalOutcome, failure_cause

CAUSE = (
    "pipeline parameters: `finetune_lora_r`=64 exceeds `serving_max_lora_rank`=8 of the vLLM runtime. "
    "Lower finetune_lora_r"
)
# The last lines kfp.local logged for a failed plan-run task (a real run, shortened; kfp.local passes the task's
# lines on as they are, the traceback's frames indented).
TAIL = [
    '    "outputFile": "/w/kfp/llm-finetune-2026-11-28/plan-run/executor_output.json"',
    "}",
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    '  File "/venv/lib/python3.11/site-packages/kfp/dsl/executor.py", line 453, in execute',
    "    result = self.func(**func_kwargs)",
    "             ^^^^^^^^^^^^^^^^^^^^^^^^",
    '  File "/repo/llmft/components/lib/plan/checks.py", line 268, in check_serving',
    "    raise ConfigError(",
    f"llmft.trainer.errors.ConfigError: {CAUSE}",
]
REFUSED = (
    "best checkpoint step-2 has heldout.contains 0.0000 but must be above 0.0100 (base 0.0000 with the 0.0100 points "
    "margin): refusing to promote"
)
# What the promote step left before issue 44: a traceback ending in PromotionRefused (no "Error" in its name),
# which the screen showed as the executor's JSON with no reason.
REFUSED_TAIL = [
    '    "outputFile": "/w/kfp/llm-finetune-2026-12-01/promote-best-checkpoint/executor_output.json"',
    "  }",
    "}",
    "Traceback (most recent call last):",
    '  File "/repo/llmft/components/lib/evaluation/promote.py", line 212, in promote',
    '    raise PromotionRefused(f"{decision.reason} (decision recorded in {record_path})")',
    f"llmft.components.lib.evaluation.promote.PromotionRefused: {REFUSED} (decision recorded in /w/x.decision.json)",
]


def failed_outcome(tail=TAIL) -> LocalOutcome:
    return LocalOutcome(False, {}, Path("/w/run-local.log"), failed_task="plan-run", failure_tail=list(tail))


def test_the_screen_shows_the_error_without_the_traceback():
    shown = failed_outcome().render(3.0)
    assert "Traceback" not in shown and 'File "' not in shown and "^^^" not in shown
    assert f"| llmft.trainer.errors.ConfigError: {CAUSE}" in shown and "in task plan-run" in shown
    assert shown.splitlines()[0] == f"pipeline FAILED after 3 s in task plan-run: {CAUSE}"  # the reason comes first


def test_any_exception_class_ending_a_traceback_is_the_reason_not_the_executor_json():
    """Issue 44 item 2: a task that raised a class whose name has no Error/Exception (PromotionRefused) showed the
    executor's JSON tail and 'see its log lines above'; the reason is the line that ends the traceback."""
    outcome = failed_outcome(REFUSED_TAIL)
    assert outcome.failure_line().startswith(f"pipeline task plan-run failed: {REFUSED}")
    shown = outcome.render(5.0)
    assert shown.splitlines()[0].endswith(REFUSED + " (decision recorded in /w/x.decision.json)")
    assert "raise PromotionRefused" not in shown


def test_a_steps_own_error_line_wins_over_an_earlier_traceback():
    tail = [*TAIL, "error (exit 200): the MLflow tracking store /w/mlflow.db is full; re-run"]
    assert failure_cause(tail) == "the MLflow tracking store /w/mlflow.db is full; re-run"
    assert failure_cause(["just a line", "another"]) == ""


def test_the_failure_line_names_the_task_and_its_error():
    assert failed_outcome().failure_line() == f"pipeline task plan-run failed: {CAUSE} (full log: /w/run-local.log)"
    printed = failed_outcome(["tokenizing ...", "error: train.jsonl:3: bad row; fix it", "cleanup done"])
    assert printed.failure_line().startswith("pipeline task plan-run failed: train.jsonl:3: bad row; fix it")


def test_run_local_prints_one_error_line_on_stderr(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("llmft.commands.pipeline_run.run_pipeline_locally", lambda *a, **k: failed_outcome())
    assert llmft_main(["pipeline", "run-local", "--work-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert err == f"error: pipeline task plan-run failed: {CAUSE} (full log: /w/run-local.log)\n"
    assert "Traceback" not in out and "pipeline FAILED" in out
