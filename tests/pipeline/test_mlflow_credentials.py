"""A password in MLFLOW_TRACKING_URI is never printed or written (issue 27.2).

A real `llmft train` (tiny model) and the register step run against a live `mlflow server` on
loopback with ``http://alice:<canary>@127.0.0.1:PORT``: the canary must not appear in their stdout
or stderr (MLflow's own "View run ... at: URL" line included), in any file they wrote, or in the
server's store. The server does not check credentials; the point is what the clients print.
docs/failure-modes.md has a row per test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from llmft.trainer.mlflow_settings import CREDENTIAL_VARS, tracking_uri_without_credentials

REGISTER_SCRIPT = """
import sys
from pathlib import Path
from llmft.components.lib.registry.mlflow_registry import Lineage, Registration, register_adapter
lineage = Lineage(pipeline_run_id="run-canary", task="register-model", dataset_hash="d" * 64, base_model="tiny")
reg = Registration(model_name=sys.argv[2], experiment="llmft-canary", adapter_dir=Path(sys.argv[1]), perplexity=9.0,
                   lineage=lineage)
print(register_adapter(reg))
"""


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, tiny_model_dir) -> Path:
    from llmft.demo import sample_path
    from llmft.trainer.data.prepare import prepare_dataset
    from llmft.trainer.data.tokenize import tokenize_dataset

    root = tmp_path_factory.mktemp("canary-data")
    prepare_dataset(str(sample_path("alpaca_demo")), root / "prepared", val_fraction=0.1)
    tokenize_dataset(root / "prepared", str(tiny_model_dir), root / "tokenized", max_length=128, pack=True, num_proc=1)
    return root / "tokenized"


def _env(uri: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LANGFUSE_", "LLMFT_"))}
    return {**env, "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


@pytest.mark.slow
def test_a_password_in_the_tracking_uri_is_never_printed_or_written(
    mlflow_server, tokenized, tiny_model_dir, tmp_path, tmp_path_factory
):
    canary = f"canary{uuid.uuid4().hex[:12]}"
    host = mlflow_server.removeprefix("http://")
    uri = f"http://alice:pw%21{canary}@{host}"  # %21 = "!": the password is percent-decoded, as a URL's is
    overrides = [f"model.name_or_path={tiny_model_dir}", f"data={tokenized}", f"output_dir={tmp_path / 'run'}"]
    overrides += ["lora.r=4", "max_steps=2", "eval_every=1", "observe.progress_bar=false"]
    overrides += ["batch.global_sequences=4", "batch.micro_sequences=2", "eval.max_sequences=8"]
    overrides += ["observe.mlflow_experiment=llmft-canary"]
    llmft = [str(Path(sys.executable).parent / "llmft")]
    train = subprocess.run(
        [*llmft, "train", *overrides], capture_output=True, text=True, timeout=300, env=_env(uri), cwd=tmp_path
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert "mlflow: logging to run" in train.stdout and "View run" in train.stdout  # MLflow's own line is there
    register = subprocess.run(
        [sys.executable, "-c", REGISTER_SCRIPT, str(tmp_path / "run" / "final"), f"canary-{canary[-6:]}"],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(uri),
        cwd=tmp_path,
    )
    assert register.returncode == 0, register.stderr[-3000:]
    assert "'version': '1'" in register.stdout

    for name, text in [("train", train.stdout + train.stderr), ("register", register.stdout + register.stderr)]:
        assert canary not in text and "alice:" not in text, f"{name} printed the credentials"
    stores = list(tmp_path_factory.getbasetemp().glob("mlflow-server*"))  # the server's database and artifacts
    assert stores
    for root in (tmp_path, *stores):
        assert not _files_holding(root, canary.encode()), f"the password was written to {root}"

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("llmft-canary")
    runs = client.search_runs([experiment.experiment_id])
    # the training run, the register run and the pipeline run's parent (lib/registry/lineage.py) the latter nests under
    assert {run.info.status for run in runs} == {"FINISHED"} and len(runs) == 3


def test_credentials_move_from_the_uri_into_mlflows_variables(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", *CREDENTIAL_VARS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://bob:p%40ss%3Aword@mlflow.example:5000/path")
    assert tracking_uri_without_credentials() == "https://mlflow.example:5000/path"
    assert os.environ["MLFLOW_TRACKING_URI"] == "https://mlflow.example:5000/path"  # children inherit it clean
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "bob" and os.environ["MLFLOW_TRACKING_PASSWORD"] == "p@ss:word"

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "exported")  # what the user exported wins, as in MLflow
    assert tracking_uri_without_credentials("http://carol:other@h:1") == "http://h:1"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "exported"
    assert tracking_uri_without_credentials("sqlite:///x.db") == "sqlite:///x.db"  # no HTTP: untouched


def test_a_tracking_uri_parameter_with_a_password_is_refused_without_echoing_it():
    from plan_helpers import make_plan

    from llmft.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="mlflow_tracking_uri.*MLFLOW_TRACKING_PASSWORD") as refused:
        make_plan(mlflow_tracking_uri="http://alice:hunter2@mlflow.example:5000")
    assert "hunter2" not in str(refused.value) and "***@mlflow.example:5000" in str(refused.value)


CANARY_URI = "http://alice:s3cr3tCANARY@127.0.0.1:5055"


def test_run_local_refuses_a_password_in_a_parameter_before_kfp_local_sees_it(tmp_path, capsys):
    """Issue 35 item 2: kfp.local logged the plan task's inputs verbatim (run-local.log, and stdout with
    --verbose) before the plan step refused the parameter. Now the command refuses it first, in one line."""
    from llmft.cli import main as llmft_main

    work = tmp_path / "w"
    code = llmft_main(
        ["pipeline", "run-local", "--verbose", "--work-dir", str(work), f"mlflow_tracking_uri={CANARY_URI}"]
    )
    out, err = capsys.readouterr()
    assert code == 1 and "s3cr3tCANARY" not in out + err
    assert err.count("\n") == 1 and "mlflow_tracking_uri" in err and "***@127.0.0.1:5055" in err
    assert not work.exists()  # nothing ran, nothing was written


@pytest.mark.parametrize(
    "command",
    [
        ["pipeline", "render-job", "--backend", "pytorchjob", "--output", "j.yaml"],
        ["sweep", "create", "--dry-run", "data=/d"],
    ],
)
def test_every_parameter_taking_command_refuses_a_password(command, tmp_path, capsys, monkeypatch):
    from llmft.cli import main as llmft_main

    monkeypatch.chdir(tmp_path)
    assert llmft_main([*command, f"mlflow_tracking_uri={CANARY_URI}"]) == 1
    out, err = capsys.readouterr()
    assert "s3cr3tCANARY" not in out + err and "***@127.0.0.1" in err
    assert not list(tmp_path.iterdir())


def test_the_local_run_log_and_screen_never_show_a_password():
    """Whatever reaches kfp.local's output (a URL from the environment, an exception) is redacted."""
    import io

    from llmft.pipelines.local_run import ProgressStream

    log, screen = io.StringIO(), io.StringIO()
    stream = ProgressStream(log, screen, verbose=True)
    text = f"inputs: {{'mlflow_tracking_uri': '{CANARY_URI}', 'base_model': 'https://bob:pw@hub.example/m'}}\n"
    assert stream.write(text) == len(text)
    for shown in (log.getvalue(), screen.getvalue()):
        assert "s3cr3tCANARY" not in shown and "bob:pw" not in shown
        assert "http://***@127.0.0.1:5055" in shown and "https://***@hub.example/m" in shown
