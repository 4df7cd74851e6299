"""The pipeline from data where it lives: one kfp.local run of the whole pipeline (tiny model) whose dataset is an
s3:// prefix on a real S3-compatible server on loopback (moto's ThreadedMotoServer), its Q&A columns mapped by
dataset_columns, the AWS_* variables in the environment as the s3 Secret puts them into the prepare task on a
cluster (tests/pipeline/test_pipeline_compile.py checks that the compiled YAML mounts it there, and only there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

DATA_TESTS = Path(__file__).resolve().parents[1] / "data"
if str(DATA_TESTS) not in sys.path:  # remote_servers.py: the loopback servers of the data tests
    sys.path.insert(0, str(DATA_TESTS))

from remote_servers import (  # noqa: E402
    AWS_TEST_KEYS,
    QA_ROWS,
    fresh_bucket,
    put_objects,
    qa_csv,
    qa_jsonl,
    s3_env,
    s3_server,
)

SHORT_RUN = {
    "finetune_max_steps": 4,
    "finetune_save_every": 2,
    "finetune_eval_every": 2,
    "finetune_batch_size": 4,
    "finetune_overrides": "log_every=1 keep_last=2 schedule.warmup_steps=1 observe.progress_bar=false",
    "serving_deploy": False,
    "promote_eval_tasks": "",
}


@pytest.mark.slow
def test_a_run_from_an_s3_prefix_with_mapped_columns_completes(tmp_path, tiny_model_dir, monkeypatch):
    from llmft.pipelines.local_run import run_pipeline_locally

    bucket = fresh_bucket("team-data")
    with s3_server() as endpoint:
        put_objects(
            endpoint, bucket, {"qa/part-0.jsonl": qa_jsonl(QA_ROWS[:40]), "qa/part-1.csv": qa_csv(QA_ROWS[40:])}
        )
        for name, value in s3_env(endpoint).items():  # kfp.local: the tasks inherit this environment
            monkeypatch.setenv(name, value)
        arguments = {
            **SHORT_RUN,
            "base_model": str(tiny_model_dir),
            "dataset": f"s3://{bucket}/qa/",
            "dataset_columns": "prompt:question,completion:answer",
        }
        outcome = run_pipeline_locally(arguments, work_dir=tmp_path / "work")
    log = outcome.log_path.read_text()
    assert outcome.succeeded, outcome.render(0) + log[-4000:]
    data = outcome.facts["data"]
    assert data["source_kind"] == "s3" and data["accepted"] == len(QA_ROWS) and data["format"] == "prompt_completion"
    assert data["source_files"] == [f"s3://{bucket}/qa/part-0.jsonl", f"s3://{bucket}/qa/part-1.csv"]
    assert outcome.facts["training"] and outcome.facts["evaluation"]["checkpoints"]
    assert all(value not in log for value in AWS_TEST_KEYS.values())


def test_a_presigned_url_is_refused_before_kfp_local_or_the_kfp_ui_sees_it(tmp_path, capsys):
    """A presigned URL is a credential: as a parameter, the KFP UI and kfp.local's log of the plan task's inputs
    would show it. The command refuses it first, in one line that shows the URL without its query."""
    from llmft.cli import main

    work = tmp_path / "w"
    url = "https://team-data.s3.amazonaws.com/qa.jsonl?X-Amz-Credential=AKIA&X-Amz-Signature=CANARYsig"
    assert main(["pipeline", "run-local", "--work-dir", str(work), f"dataset={url}"]) == 1
    out, err = capsys.readouterr()
    assert "CANARYsig" not in out + err and err.count("\n") == 1
    assert "`dataset`='https://team-data.s3.amazonaws.com/qa.jsonl?<query hidden>'" in err and "s3_secret" in err
    assert not work.exists()
