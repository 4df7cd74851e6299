"""`llmft pipeline compile promote_eval_tasks=mmlu` (issue 45's probe: "bakes in a default every run fails on").

Compile runs where the data volume is not: a laptop, CI. Whether a run can score an lm-eval registry task depends
on that volume's eval cache (or a hub the cluster reaches), so compile cannot refuse it without refusing the users
who filled the cache; it says, in one note, what every run's plan step will check and the command that prepares
for it. What no volume can fix (a name no task has, a relative task file, a metric or guard no selected task
computes) is refused at compile time in the plan step's own words, exit 1, before anything is compiled.
"""

from __future__ import annotations

import pytest

from llmft.components.lib.evaluation import task_plan
from llmft.components.lib.evaluation.task_plan import compiled_eval_notes
from llmft.trainer.errors import ConfigError


@pytest.fixture
def no_lm_eval_here(monkeypatch):
    """A compile machine with the `pipeline` extra only: lm-eval's registry is not installed there."""
    monkeypatch.setattr(task_plan, "registry_dir", lambda: None)


def test_a_registry_task_compiled_in_gets_a_note_naming_the_cache_command(no_lm_eval_here):
    (note,) = compiled_eval_notes("heldout,mmlu,arc_easy", "heldout.contains", "mmlu.acc:0.02")
    assert "lm-eval registry task(s) mmlu, arc_easy" in note and "every run's plan step refuses" in note
    assert "`llmft eval cache mmlu arc_easy --cache <dir>`" in note and "/data/eval-cache" in note


def test_shipped_tasks_need_no_note():
    assert compiled_eval_notes("heldout,velmora_mc", "velmora_mc.acc", "heldout.token_f1:0.05") == []
    assert compiled_eval_notes("", "perplexity", "") == []


@pytest.mark.parametrize(
    ("tasks", "metric", "guards", "refusal"),
    [
        ("heldout", "arc_easy.acc", "", "`promote_metric`='arc_easy.acc': not a metric this run computes"),
        ("heldout,mmlu", "perplexity", "hellaswag.acc", "`promote_guards`: 'hellaswag.acc' is not a metric"),
        ("heldout,tasks/t.yaml", "perplexity", "", "'tasks/t.yaml': give a task file's absolute path"),
        ("heldout,perplexity", "perplexity", "", "perplexity is always computed; leave it out"),
        ("heldout,bad name!", "perplexity", "", "'bad name!' is not a task name"),
    ],
)
def test_what_no_volume_can_fix_is_refused_at_compile_time(no_lm_eval_here, tasks, metric, guards, refusal):
    with pytest.raises(ConfigError) as refused:
        compiled_eval_notes(tasks, metric, guards)
    assert refusal in str(refused.value) and "\n" not in str(refused.value)


def test_a_task_file_on_the_volume_is_left_to_the_plan_step():
    (note,) = compiled_eval_notes("heldout,/data/tasks/t.yaml", "my_task.acc", "my_task.f1")
    assert "task file(s) /data/tasks/t.yaml: read from the data volume by every run's plan step" in note


@pytest.mark.slow
def test_compile_says_it_before_compiling_and_refuses_an_unknown_task(tmp_path, capsys):
    """Through the command, with the installed lm-eval's registry (its YAMLs scanned, nothing imported)."""
    from llmft.cli import main as llmft_main

    output = tmp_path / "p.yaml"
    assert llmft_main(["pipeline", "compile", "promote_eval_tasks=heldout,mmlu", "--output", str(output)]) == 0
    err = capsys.readouterr().err
    assert (
        err.startswith("note: promote_eval_tasks compiled in with lm-eval registry task(s) mmlu") and output.is_file()
    )
    assert "`llmft eval cache mmlu --cache <dir>`" in err
    unknown = tmp_path / "q.yaml"
    assert llmft_main(["pipeline", "compile", "promote_eval_tasks=mmlu_nosuch", "--output", str(unknown)]) == 1
    err = capsys.readouterr().err
    assert "'mmlu_nosuch' is not heldout, a shipped task" in err and not unknown.exists()
