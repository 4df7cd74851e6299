"""Issue 27 items 5 and 6.1: `llmft pipeline compile` and `render-job` follow the output-ownership rules
of the other commands (llmft/trainer/io.py write_owned_file): a file llmft did not write is replaced only
with --force, a symlink is never written through (--force replaces the link itself), the write is
atomic, and an --output that is not .yaml/.yml is one line with exit 1 (was exit 3, "internal error").
Before the fix both commands overwrote any file and wrote through a symlink into its target."""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml

from llmft.cli import main
from llmft.trainer.io import OWNED_FILE_MARK

MINE = "my own notes, not a pipeline\n"
RENDER = ["pipeline", "render-job", "--backend", "pytorchjob", "mlflow_tracking_uri=http://mlflow:5000"]
COMPILE = ["pipeline", "compile"]


def cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.mark.parametrize("command", [COMPILE, RENDER], ids=["compile", "render-job"])
def test_a_file_llmft_did_not_write_is_kept_without_force(tmp_path, command):
    out = tmp_path / "job.yaml"
    out.write_text(MINE)
    code, err = cli(*command, "--output", str(out))
    assert code == 1 and err.count("\n") == 1 and "did not write" in err and "--force" in err, err
    assert out.read_text() == MINE


@pytest.mark.parametrize("command", [COMPILE, RENDER], ids=["compile", "render-job"])
def test_a_symlink_output_is_never_written_through(tmp_path, command):
    target = tmp_path / "precious.yaml"
    target.write_text(MINE)
    link = tmp_path / "out.yaml"
    link.symlink_to(target)
    code, err = cli(*command, "--output", str(link))
    assert code == 1 and err.count("\n") == 1 and "is a symlink" in err, err
    assert target.read_text() == MINE and link.is_symlink()


@pytest.mark.parametrize("command", [COMPILE, RENDER], ids=["compile", "render-job"])
@pytest.mark.parametrize("name", ["pipeline.json", "pipeline"])
def test_an_output_that_is_not_yaml_is_one_line_exit_1(tmp_path, command, name):
    code, err = cli(*command, "--output", str(tmp_path / name))
    assert code == 1 and err.count("\n") == 1 and ".yaml" in err and "internal error" not in err, err
    assert not (tmp_path / name).exists()


@pytest.mark.slow  # builds three plans (imports the pipelines): about 10 s
def test_render_job_replaces_its_own_file_and_with_force_the_link_itself(tmp_path):
    out = tmp_path / "job.yaml"
    assert cli(*RENDER, "--output", str(out))[0] == 0
    first = out.read_text()
    assert first.startswith(OWNED_FILE_MARK) and yaml.safe_load(first)["kind"] == "PyTorchJob"
    assert cli(*RENDER, "training_workers=2", "--output", str(out))[0] == 0  # ours: replaced without --force
    assert (
        yaml.safe_load(out.read_text())["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    )  # training_workers=2
    target = tmp_path / "precious.yaml"
    target.write_text(MINE)
    link = tmp_path / "linked.yaml"
    link.symlink_to(target)
    assert cli(*RENDER, "--output", str(link), "--force")[0] == 0
    assert target.read_text() == MINE and not link.is_symlink() and link.read_text().startswith(OWNED_FILE_MARK)
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_compile_replaces_its_own_file_and_a_foreign_one_with_force(tmp_path):
    out = tmp_path / "p.yaml"
    assert cli(*COMPILE, "--output", str(out))[0] == 0
    assert out.read_text().startswith(OWNED_FILE_MARK)
    assert cli(*COMPILE, "finetune_lora_r=32", "--output", str(out))[0] == 0  # ours: replaced without --force
    spec, _platform = yaml.safe_load_all(out.read_text())
    assert spec["root"]["inputDefinitions"]["parameters"]["finetune_lora_r"]["defaultValue"] == 32
    out.write_text(MINE)
    assert cli(*COMPILE, "--output", str(out), "--force")[0] == 0
    assert out.read_text().startswith(OWNED_FILE_MARK)


def test_render_job_hpo_checks_the_sweep_pipelines_trial_overrides(tmp_path):
    """`--hpo` renders with the HPO pipeline's plan checks: trust_remote_code in the trial overrides is refused there
    as in its plan step (rendered as the plain pipeline it was accepted: exit 0, a job written)."""
    out = tmp_path / "job.yaml"
    argv = ["pipeline", "render-job", "--backend", "pytorchjob", "--hpo", "--output", str(out)]
    code, err = cli(*argv, "mlflow_tracking_uri=http://mlflow:5000", "hpo_trial_overrides=model.trust_remote_code=true")
    assert code == 1 and "trust_remote_code" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob"])
def test_render_job_shows_the_config_file_the_job_reads(tmp_path, backend):
    """Issue 26: the rendered job runs `llmft train --config <run_dir>/config.yaml data=...` (no plan setting
    on its command line); the header shows that config.yaml, finetune_lora_r=8 as lora.r: 8."""
    out = tmp_path / "job.yaml"
    argv = [
        "pipeline",
        "render-job",
        "--backend",
        backend,
        "mlflow_tracking_uri=http://mlflow:5000",
        "finetune_lora_r=8",
    ]
    assert cli(*argv, "--run-id", "r1", "--output", str(out))[0] == 0
    text = out.read_text()
    body = yaml.safe_load(text)
    spec = body["spec"]
    if backend == "trainjob":
        args = spec["trainer"]["args"]
    else:
        args = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"]
    assert args[3:] == ["--config", "/data/runs/r1/config.yaml", "data=/data/tokenized/CACHE_KEY"]
    header = [line.removeprefix("#   ") for line in text.splitlines() if line.startswith("#   ")]
    assert header[0] == "/data/runs/r1/config.yaml:" and yaml.safe_load("\n".join(header[1:]))["lora"]["r"] == 8
