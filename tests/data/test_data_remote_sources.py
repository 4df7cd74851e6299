"""`llmft data prepare` from where the data lives: an https:// file on a real HTTPS server (a CA made in the test,
trusted through SSL_CERT_FILE or REQUESTS_CA_BUNDLE as a user would) and s3:// objects on a real S3-compatible
server (moto's ThreadedMotoServer, boto3 over HTTP through AWS_ENDPOINT_URL), both on loopback, each with a column
mapping; and what a failed fetch leaves (nothing) and says (one line, never a credential)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from data_helpers import read_jsonl
from remote_servers import (
    AWS_TEST_KEYS,
    QA_ROWS,
    HttpsFiles,
    fresh_bucket,
    put_objects,
    qa_csv,
    qa_jsonl,
    s3_env,
    s3_server,
)

pytestmark = pytest.mark.slow
COLUMNS = "prompt:question,completion:answer"
SIGNATURE = "X-Amz-Signature=c0ffee0123456789deadbeef"


def _llmft() -> list[str]:
    script = Path(sys.executable).parent / "llmft"
    return [str(script)] if script.exists() else [sys.executable, "-m", "llmft"]


def prepare(source: str, output: Path, *extra: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The real CLI in a fresh process, with a clean environment plus ``env`` (no AWS or CA settings leak in)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SSL_CERT", "REQUESTS_CA", "CURL_CA"))}
    command = [*_llmft(), "data", "prepare", "--input", source, "--output", str(output), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env={**base, **env})


def everything_written(run: subprocess.CompletedProcess, folder: Path) -> str:
    files = [p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    return run.stdout + run.stderr + "".join(files)


@pytest.fixture
def https(tmp_path):
    with HttpsFiles(tmp_path) as server:
        server.files["/exports/qa.csv"] = qa_csv()
        server.files["/exports/qa.jsonl"] = qa_jsonl()
        yield server


@pytest.mark.parametrize("ca_variable", ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"])
def test_an_https_csv_with_a_column_mapping_is_prepared(https, tmp_path, ca_variable):
    out = tmp_path / "out"
    url = f"{https.url}/exports/qa.csv?{SIGNATURE}"
    run = prepare(url, out, "--columns", COLUMNS, env={ca_variable: str(https.ca_file)})
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["accepted"] == len(QA_ROWS) and report["format"] == "prompt_completion"
    assert report["source"] == report["source_files"][0] == f"{https.url}/exports/qa.csv?<query hidden>"
    assert report["source_kind"] == "https" and report["columns"] == {"prompt": "question", "completion": "answer"}
    train = read_jsonl(out / "train.jsonl") + read_jsonl(out / "val.jsonl")
    assert {"role": "assistant", "content": "14"} in [row["messages"][1] for row in train]
    assert sorted(p.name for p in out.iterdir()) == [
        ".llmft-owner.json",
        "COMPLETE",
        "rejects.jsonl",
        "report.json",
        "train.jsonl",
        "val.jsonl",
    ]  # fmt: skip  (the download is gone: read, hashed, removed)
    assert SIGNATURE not in everything_written(run, out)
    assert https.requests[0][1] == f"/exports/qa.csv?{SIGNATURE}"  # the server did get the signed query


def test_the_same_rows_give_the_same_source_hash_as_a_local_file(https, tmp_path):
    (tmp_path / "qa.jsonl").write_bytes(qa_jsonl())
    local = prepare(str(tmp_path / "qa.jsonl"), tmp_path / "local", "--columns", COLUMNS, env={})
    remote = prepare(
        f"{https.url}/exports/qa.jsonl",
        tmp_path / "remote",
        "--columns",
        COLUMNS,
        env={"SSL_CERT_FILE": str(https.ca_file)},
    )
    assert local.returncode == remote.returncode == 0, local.stderr + remote.stderr
    hashes = [json.loads((tmp_path / d / "report.json").read_text())["source_hash"] for d in ("local", "remote")]
    assert hashes[0] == hashes[1]
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "remote" / name).read_bytes()


def test_an_untrusted_certificate_is_one_line_naming_the_ca_variables(https, tmp_path):
    run = prepare(f"{https.url}/exports/qa.csv", tmp_path / "out", env={})
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "certificate is not trusted" in run.stderr
    assert "REQUESTS_CA_BUNDLE" in run.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("path", "code", "words"),
    [
        ("/status/404/qa.csv", 1, "HTTP 404"),
        ("/status/403/qa.csv", 1, "presigned URL may have expired"),
        ("/status/503/qa.csv", 200, "HTTP 503"),
        ("/cut/exports/qa.csv", 200, "the transfer ended after"),
        ("/redirect-to-http/qa.csv", 1, "redirects to plain http"),
    ],
)
def test_a_failed_download_leaves_nothing_and_says_why(https, tmp_path, path, code, words):
    out = tmp_path / "out"
    run = prepare(f"{https.url}{path}?{SIGNATURE}", out, env={"SSL_CERT_FILE": str(https.ca_file)})
    assert run.returncode == code, run.stderr
    assert words in run.stderr and run.stderr.startswith("error: ") and run.stderr.count("\n") == 1
    assert SIGNATURE not in run.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_the_size_bound_stops_a_download_announced_or_not(https, tmp_path):
    env = {"SSL_CERT_FILE": str(https.ca_file)}
    announced = prepare(f"{https.url}/exports/qa.csv", tmp_path / "a", "--max-fetch-bytes", "1000", env=env)
    assert announced.returncode == 1 and "above the fetch limit of 1,000 bytes" in announced.stderr
    streamed = prepare(f"{https.url}/unsized/exports/qa.csv", tmp_path / "b", "--max-fetch-bytes", "1000", env=env)
    assert streamed.returncode == 1 and "more than 1,000 bytes" in streamed.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    unsized = prepare(f"{https.url}/unsized/exports/qa.csv", tmp_path / "c", "--columns", COLUMNS, env=env)
    assert unsized.returncode == 0, unsized.stderr


BUCKET = fresh_bucket("team-data")


@pytest.fixture(scope="module")
def s3():
    with s3_server() as endpoint:
        put_objects(
            endpoint,
            BUCKET,
            {
                "qa/2026/part-0001.jsonl": qa_jsonl(QA_ROWS[:30]),
                "qa/2026/part-0002.csv": qa_csv(QA_ROWS[30:]),
                "qa/2026/.staging/part-0003.jsonl": b"not data\n",
                "qa/2026/_SUCCESS": b"",
                "one/qa.jsonl": qa_jsonl(),
            },
        )
        yield endpoint


def test_an_s3_prefix_with_a_column_mapping_is_prepared(s3, tmp_path):
    out = tmp_path / "out"
    run = prepare(f"s3://{BUCKET}/qa/2026/", out, "--columns", COLUMNS, env=s3_env(s3))
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["source_kind"] == "s3" and report["accepted"] == len(QA_ROWS)
    assert report["source_files"] == [f"s3://{BUCKET}/qa/2026/part-0001.jsonl", f"s3://{BUCKET}/qa/2026/part-0002.csv"]
    written = everything_written(run, out)
    assert all(value not in written for value in AWS_TEST_KEYS.values())
    assert f"s3://{BUCKET}/qa/2026/" in run.stdout


def test_one_s3_object_and_the_errors_of_a_store(s3, tmp_path):
    env = s3_env(s3)
    one = prepare(f"s3://{BUCKET}/one/qa.jsonl", tmp_path / "one", "--columns", COLUMNS, env=env)
    assert one.returncode == 0, one.stderr
    missing = prepare(f"s3://{BUCKET}/one/nope.jsonl", tmp_path / "missing", env=env)
    assert missing.returncode == 1 and "not found" in missing.stderr
    empty = prepare(f"s3://{BUCKET}/empty/", tmp_path / "empty", env=env)
    assert empty.returncode == 1 and "no .jsonl/.json/.csv/.parquet objects under this prefix" in empty.stderr
    no_keys = {k: v for k, v in env.items() if not k.startswith("AWS_ACCESS") and not k.startswith("AWS_SECRET")}
    no_keys["AWS_SHARED_CREDENTIALS_FILE"] = no_keys["AWS_CONFIG_FILE"] = str(tmp_path / "none")
    anonymous = prepare(f"s3://{BUCKET}/one/qa.jsonl", tmp_path / "anonymous", env=no_keys)
    assert anonymous.returncode == 1 and "no AWS credentials" in anonymous.stderr and "s3_secret" in anonymous.stderr
    down = prepare(
        f"s3://{BUCKET}/one/qa.jsonl", tmp_path / "down", env={**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    )
    assert down.returncode == 200 and "did not answer" in down.stderr
    for run in (missing, empty, anonymous, down):
        assert run.stderr.count("\n") == 1, run.stderr
    assert not any((tmp_path / d).exists() for d in ("missing", "empty", "anonymous", "down"))


def test_a_hub_configuration_is_passed_to_datasets(tmp_path):
    """The real datasets.load_dataset on a dataset folder laid out as on the hub (README.md `configs:`): the
    configuration name selects the data (no hub is reachable here, so the folder stands in for the id)."""
    from llmft.trainer.data.sources import load_hub_dataset

    folder = tmp_path / "acme-qa"
    (folder / "easy").mkdir(parents=True)
    (folder / "hard").mkdir()
    (folder / "easy" / "train.jsonl").write_bytes(qa_jsonl(QA_ROWS[:3]))
    (folder / "hard" / "train.jsonl").write_bytes(qa_jsonl(QA_ROWS[3:8]))
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: easy\n  data_files: easy/train.jsonl\n"
        "- config_name: hard\n  data_files: hard/train.jsonl\n---\n"
    )
    hard = list(load_hub_dataset(str(folder), "train", "hard"))
    assert [row["id"] for row in hard] == [3, 4, 5, 6, 7]
    assert [row["id"] for row in load_hub_dataset(str(folder), "train", "easy")] == [0, 1, 2]
