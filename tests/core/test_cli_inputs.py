"""Command-line inputs checked before any work (issue 35, Low items): a namespace is a Kubernetes name, an
output folder can be written before a slow build."""

from __future__ import annotations

import pytest

from llmft.cli import main as llmft_main


@pytest.mark.parametrize(
    "command",
    [
        ["pipeline", "render-job", "--backend", "pytorchjob", "--output", "job.yaml"],
        ["sweep", "status", "x"],
        ["pipeline", "submit", "--host", "http://127.0.0.1:9"],
    ],
    ids=["render-job", "sweep-status", "pipeline-submit"],
)
def test_a_namespace_that_is_no_kubernetes_name_is_refused(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert llmft_main([*command, "--namespace", "../kube-system"]) == 1
    err = capsys.readouterr().err
    assert "--namespace='../kube-system' is not a Kubernetes name" in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())  # no manifest with the name in it


def test_real_model_checks_its_output_folder_before_converting(tmp_path, capsys):
    """`llmft dev real-model --output` under a file failed with 200 after about 20 s of conversion."""
    parent = tmp_path / "file"
    parent.write_text("x")
    assert llmft_main(["dev", "real-model", "--output", str(parent / "model"), "--source", str(tmp_path / "no")]) == 1
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and err.count("\n") == 1
