"""`llmft pipeline --help` in an install without the pipeline extra: the help works (and says what is missing); a
command is one line naming the package and the extra. The install is emulated in a fresh interpreter whose
imports of the extra's packages fail as they do where they are not installed (ModuleNotFoundError naming the
package), through a sitecustomize on PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PIPELINE_EXTRA_ONLY = ("kfp", "kfp_server_api", "urllib3", "kubernetes", "kubeflow", "mlflow", "kserve", "langfuse")
"""Top-level packages a base or trainer install lacks that the pipeline extra brings (urllib3: the base install
has none; the trainer extra's packages do not depend on it)."""

BLOCKER = """
import sys
from importlib.abc import MetaPathFinder

BLOCKED = {blocked!r}


class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
"""


def _llmft(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(PIPELINE_EXTRA_ONLY)))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("LLMFT_DEBUG", None)
    command = [sys.executable, "-c", "import sys; from llmft.cli import main; sys.exit(main(sys.argv[1:]))", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("args", [["pipeline", "--help"], ["pipeline", "submit", "--help"], ["pipeline", "-h"]])
def test_pipeline_help_works_without_the_pipeline_extra(tmp_path, args):
    run = _llmft(tmp_path, *args)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert "This install lacks kfp, kfp_server_api, urllib3, kubernetes" in " ".join(run.stdout.split())
    if args[1] == "submit":
        assert "--wait" in run.stdout and "--host" in run.stdout
    else:
        for command in ("compile", "run-local", "submit", "wait", "schedule", "render-job"):
            assert command in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["pipeline", "compile", "--output", "p.yaml"],
        ["pipeline", "wait", "run-1", "--host", "http://127.0.0.1:9"],
        ["pipeline", "render-job", "--backend", "pytorchjob", "--output", "j.yaml"],
    ],
)
def test_a_pipeline_command_without_the_extra_is_one_line_naming_it(tmp_path, args):
    run = _llmft(tmp_path, *args)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1, run.stderr
    assert f"error: llmft pipeline {args[1]} needs the Python package" in run.stderr
    assert "pip install 'kfp-llm-finetune[pipeline]'" in run.stderr
    assert not list(tmp_path.glob("*.yaml"))


@pytest.mark.slow
def test_with_the_extra_the_help_says_nothing_about_it(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "llmft", "pipeline", "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and "This install lacks" not in run.stdout
