"""A full disk in the evaluate step names the path (issue 45's probe, "a full disk in evaluate names no path").

The disk fills for real: the temporary file that ``atomic_write_bytes`` writes through is opened on ``/dev/full``,
whose every write fails in the kernel with ENOSPC, exactly as a full volume's does (the OSError carries no file
name: that is why the old step's line named no path). What the user sees is the step's one ``error:`` line, exit
200 (retried), naming ``evaluation.json`` or the report, and nothing half-written beside it.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest

from llmft.components.lib.evaluation.outputs import write_outputs
from llmft.components.lib.step_exit import step_outcome
from llmft.trainer import io as llmft_io
from llmft.trainer.errors import EXIT_TRANSIENT, EXIT_USER_ERROR

RESULT = {"best": "step-2", "checkpoints": [{"name": "step-2", "perplexity": 3.5}]}


@pytest.fixture
def full_disk_for(monkeypatch):
    """full_disk_for(name): every atomic write of a file called ``name`` goes to /dev/full (ENOSPC)."""

    def arm(name: str) -> None:
        real_mkstemp = tempfile.mkstemp

        def mkstemp(prefix="", suffix="", dir=None):  # noqa: A002 - tempfile's own parameter name
            if prefix == f".{name}.":
                return os.open("/dev/full", os.O_WRONLY), os.path.join(str(dir), f"{prefix}full{suffix}")
            return real_mkstemp(prefix=prefix, suffix=suffix, dir=dir)

        monkeypatch.setattr(llmft_io.tempfile, "mkstemp", mkstemp)

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    return arm


@pytest.mark.parametrize(
    ("full_file", "named", "what"),
    [
        ("evaluation.json", "evaluation/evaluation.json", "the evaluation (evaluation.json)"),
        ("report.html", "report.html", "the evaluation report (HTML)"),
    ],
)
def test_a_full_disk_in_evaluate_names_the_path_and_exits_200(tmp_path, capsys, full_disk_for, full_file, named, what):
    full_disk_for(full_file)
    evaluation_dir, report = tmp_path / "evaluation", tmp_path / "report.html"
    with pytest.raises(SystemExit) as ended, step_outcome("evaluate-perplexity"):
        write_outputs(RESULT, "<html></html>", str(evaluation_dir), str(report))
    assert ended.value.code == EXIT_TRANSIENT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {tmp_path / named}: No space left on device"), err
    assert f"writing {what}" in err and "free of" in err, err
    leftovers = [p.name for p in tmp_path.rglob("*") if p.name.startswith(".")]
    assert not leftovers and not report.exists(), leftovers  # nothing half-written, no report without its data


def test_the_evaluate_step_ends_with_one_error_line_not_a_traceback(tmp_path, capsys):
    """The evaluate component's body runs under step_outcome, as promote, register and deploy do: an LlmftError
    (here the plan artifact's file missing) is its `error:` line and exit code, not the KFP executor's traceback
    and exit 1 for everything (a full disk would not be retried)."""
    from llmft.components.evaluate import evaluate_perplexity

    missing = SimpleNamespace(path=str(tmp_path / "plan"), metadata={})
    with pytest.raises(SystemExit) as ended:
        evaluate_perplexity.python_func(
            plan=missing, tokenized=missing, run=missing, evaluation=missing, report=missing, metrics=missing
        )
    assert ended.value.code == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'plan'}/plan.json is missing") and err.count("\n") == 1, err
