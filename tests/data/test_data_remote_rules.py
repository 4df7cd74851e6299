"""The rules of remote sources that need no server: which URLs are accepted, what is shown of them, and how
each fault of a server or an object store becomes one line with its exit code (botocore's own exception
classes, as boto3 raises them)."""

from __future__ import annotations

import pytest

from llmft.trainer.data import remote
from llmft.trainer.data.remote import parse_remote, shown_url, url_credentials
from llmft.trainer.errors import EXIT_TRANSIENT, EXIT_USER_ERROR, ConfigError, DataError, TransientError

PRESIGNED = (
    "https://team-data.s3.amazonaws.com/qa/train.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=AKIAEXAMPLE%2F20261201%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature=0123abcd"
)


def test_a_url_is_shown_without_user_info_or_query():
    assert shown_url(PRESIGNED) == "https://team-data.s3.amazonaws.com/qa/train.jsonl?<query hidden>"
    assert shown_url("https://bob:hunter2@host:8443/a.csv") == "https://host:8443/a.csv"
    assert shown_url("s3://bucket/prefix/") == "s3://bucket/prefix/"
    assert "AKIAEXAMPLE" not in shown_url(PRESIGNED) and "0123abcd" not in shown_url(PRESIGNED)


def test_credentials_in_a_url_are_recognised():
    assert "presigned" in url_credentials(PRESIGNED)
    assert "sig" in url_credentials("https://acct.blob.core.windows.net/c/a.jsonl?sv=2024&sig=abc")
    assert "user:password" in url_credentials("https://bob:pw@host/a.jsonl")
    assert url_credentials("https://host/a.jsonl?download=1") == ""


def test_plain_http_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match="plain http is refused.*--allow-http"):
        parse_remote("http://mirror.internal/data.jsonl")
    assert parse_remote("http://mirror.internal/data.jsonl", allow_http=True).scheme == "http"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("https://host/data", "must end in a data file name"),
        ("https://host/export.txt", "must end in a data file name"),
        ("https:///data.jsonl", "no host"),
        ("https://bob:pw@host/data.jsonl", "carries a user name or password"),
        ("s3://Bad_Bucket/key.jsonl", "not an S3 bucket name"),
        ("s3://ab/key.jsonl", "not an S3 bucket name"),
        ("s3://bucket/key.jsonl?versionId=1", "takes no query"),
    ],
)
def test_a_malformed_remote_source_is_one_line_before_any_fetch(spec, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_remote(spec)
    assert "pw" not in str(caught.value)


def test_an_s3_key_without_a_data_suffix_is_a_prefix():
    assert parse_remote("s3://bucket/exports/2026").is_prefix
    assert parse_remote("s3://bucket").is_prefix and parse_remote("s3://bucket").key == ""
    one = parse_remote("s3://bucket/exports/train.parquet")
    assert not one.is_prefix and (one.bucket, one.key) == ("bucket", "exports/train.parquet")


def test_a_fetched_file_is_named_by_its_position_and_suffix_only():
    assert remote.local_name(3, "../../etc/evil.JSONL") == "000003.jsonl"
    assert remote.local_name(0, "a/b/c.csv") == "000000.csv"


@pytest.mark.parametrize(
    ("status", "kind", "words"),
    [
        (404, DataError, "no such file"),
        (410, DataError, "no such file"),
        (403, DataError, "presigned URL may have expired"),
        (401, DataError, "access denied"),
        (503, TransientError, "retried"),
        (429, TransientError, "busy"),
        (418, DataError, "refused the download"),
    ],
)
def test_an_http_status_is_permanent_or_transient(status, kind, words):
    error = remote._http_status_error("https://host/a.jsonl", status, "Reason")
    assert type(error) is kind and words in str(error)
    assert error.exit_code == (EXIT_TRANSIENT if kind is TransientError else EXIT_USER_ERROR)


def _client_error(code: str):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": 400}}, "Op")


@pytest.mark.parametrize(
    ("make", "kind", "words"),
    [
        (lambda: _client_error("NoSuchBucket"), DataError, "not found"),
        (lambda: _client_error("404"), DataError, "not found"),
        (lambda: _client_error("AccessDenied"), DataError, "access denied"),
        (lambda: _client_error("InvalidAccessKeyId"), DataError, "s3_secret"),
        (lambda: _client_error("SlowDown"), TransientError, "retried"),
        (lambda: _client_error("503"), TransientError, "retried"),
    ],
)
def test_an_object_store_error_is_permanent_or_transient(make, kind, words):
    error = remote._s3_error("s3://bucket/a.jsonl", make())
    assert type(error) is kind and words in str(error)


def test_missing_credentials_and_an_unreachable_endpoint():
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    missing = remote._s3_error("s3://b/a.jsonl", NoCredentialsError())
    assert isinstance(missing, ConfigError) and "s3_secret=NAME" in str(missing)
    down = remote._s3_error("s3://b/a.jsonl", EndpointConnectionError(endpoint_url="http://127.0.0.1:9"))
    assert isinstance(down, TransientError) and "AWS_ENDPOINT_URL" in str(down)


def test_a_connection_error_never_repeats_a_url():
    error = remote._connection_error(
        "https://host/a.jsonl?<query hidden>", OSError(f"failed for {PRESIGNED} after 3 tries")
    )
    assert isinstance(error, TransientError) and "X-Amz-Signature" not in str(error) and "<url>" in str(error)


def test_a_missing_ca_bundle_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match="REQUESTS_CA_BUNDLE=.*no such CA bundle"):
        remote.ssl_context()


def test_the_region_comes_from_aws_region(monkeypatch):
    """botocore reads AWS_DEFAULT_REGION only (1.44.8 configprovider.py line 60); users set AWS_REGION."""
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert remote.s3_client().meta.region_name == "eu-west-3"
