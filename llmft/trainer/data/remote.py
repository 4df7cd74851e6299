"""Data where it lives: ``https://`` files and ``s3://`` objects, fetched before ``llmft data prepare`` reads them.

A remote source is downloaded into the folder prepare is building (its temporary folder, renamed into place only
when everything passed), each file first as ``<name>.part`` and renamed when every byte arrived, then read like a
local file; the download is removed before the rename, so the prepared dataset holds what it always held and
report.json records the source's SHA-256. A failed or cut download leaves nothing that looks complete.

- ``https://host/path/file.jsonl`` (also .json, .csv, .parquet): one file. The server's certificate is verified
  against the system's CAs, or the bundle named by ``REQUESTS_CA_BUNDLE`` / ``CURL_CA_BUNDLE`` (as requests and
  curl read them), or OpenSSL's ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``. ``HTTPS_PROXY`` / ``NO_PROXY`` apply. A
  redirect to plain http is refused.
- ``http://`` is refused unless allowed (``--allow-http``): rows fetched in clear text can be altered on the way,
  and they become the model's weights. On a cluster, an in-cluster object store over http is reached as
  ``s3://`` with ``AWS_ENDPOINT_URL`` in the s3 Secret: the administrator's explicit choice.
- ``s3://bucket/key.jsonl`` (one object) or ``s3://bucket/prefix/`` (every data object under it, in key order;
  hidden names skipped), through boto3 (the ``s3`` extra, in the trainer image) with its usual configuration:
  ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` /
  ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` (an S3-compatible store: MinIO, Ceph),
  or a pod's web identity (IRSA). In the pipeline they come from the Secret named by ``s3_secret``.

Sizes are bounded (``max_bytes``, default :data:`DEFAULT_MAX_FETCH_BYTES`, and :data:`MAX_OBJECTS` objects),
checked before the first byte where the server says the size, and while reading where it does not. Nothing
shown (labels, errors, report.json) carries credentials: a URL is shown without its user info and query string
(a presigned URL's signature), never with them.

Faults: a server that does not answer, a 5xx or 429, a cut transfer -> :class:`TransientError` (exit 200, the
pipeline retries); not found, access denied, an untrusted certificate, a size above the bound ->
:class:`DataError` / :class:`ConfigError` (exit 1), each one line naming the source and the fix.
"""

from __future__ import annotations

import errno
import os
import re
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from llmft.trainer.errors import ConfigError, DataError, TransientError
from llmft.trainer.storage import DiskFullError, disk_fault, disk_fault_message, free_bytes, human

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
"""What a fetched file may be (llmft/trainer/data/sources.py reads these; the same list)."""
REMOTE_SCHEMES = ("https://", "http://", "s3://")
DEFAULT_MAX_FETCH_BYTES = 32 << 30
"""32 GiB: larger than any fine-tuning set we know of, small enough that a URL pointing at a dump by mistake stops
before it fills the volume. ``--max-fetch-bytes`` raises it."""
MAX_OBJECTS = 10_000
"""Objects under one s3:// prefix; more is a wrong prefix, or data to consolidate first."""
CONNECT_TIMEOUT_S = 30.0
"""Seconds to connect, and the longest silence while reading (socket timeout), before a transient error."""
CHUNK_BYTES = 1 << 20
CA_BUNDLE_VARIABLES = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
"""A CA bundle as requests and curl take it (OpenSSL itself reads SSL_CERT_FILE / SSL_CERT_DIR)."""
_TRANSIENT_HTTP = {408, 425, 429, 500, 502, 503, 504}
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class RemoteSpec:
    """A parsed remote source. ``url`` is as given (it may carry a signed query: never shown); ``label`` is
    what every message, report and reject shows."""

    scheme: str  # https | http | s3
    url: str
    label: str
    bucket: str = ""
    key: str = ""

    @property
    def is_prefix(self) -> bool:
        """An s3:// source naming a folder of objects rather than one object."""
        return self.scheme == "s3" and not self.key.lower().endswith(DATA_SUFFIXES)


@dataclass(frozen=True)
class Fetched:
    """One downloaded file: where it is now, and the label its rows are reported under."""

    path: Path
    label: str
    size: int


def is_remote(spec: str) -> bool:
    return spec.strip().lower().startswith(REMOTE_SCHEMES)


def shown_url(url: str) -> str:
    """``url`` as it may be shown: scheme, host, port and path; no user info, no query (a presigned URL's
    signature and credential), no fragment."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    hidden = "?<query hidden>" if parts.query else ""
    return f"{parts.scheme}://{netloc}{parts.path}{hidden}"


SIGNED_QUERY_KEYS = ("x-amz-signature", "x-amz-credential", "x-amz-security-token", "x-goog-signature",
                     "x-goog-credential", "sig", "signature", "token", "access_token")  # fmt: skip
"""Query keys that make a URL a credential: AWS SigV4 and Google presigned URLs, an Azure SAS (sig), tokens."""


def url_credentials(url: str) -> str:
    """What in ``url`` is a credential ('' = nothing): user info, or a signed query key."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        return "a user name or password (user:password@)"
    keys = [key.lower() for key, _value in parse_qsl(parts.query, keep_blank_values=True)]
    signed = sorted({key for key in keys if key in SIGNED_QUERY_KEYS})
    return f"a signed query ({', '.join(signed)}: a presigned URL)" if signed else ""


def parse_remote(spec: str, *, allow_http: bool = False, where: str = "--input") -> RemoteSpec:
    """Check a remote ``spec`` before anything is fetched: its scheme, host, and a data suffix."""
    url = spec.strip()
    scheme = url.split("://", 1)[0].lower()
    label = shown_url(url)
    if scheme == "s3":
        return _parse_s3(url, label, where)
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise ConfigError(
            f"{where} {label}: the URL carries a user name or password, which logs and the KFP UI would show; "
            "serve the file without them (a presigned URL, a token-free mirror), or put it in S3 and read it as "
            "s3://bucket/key with the credentials in the environment (the s3_secret in the pipeline)"
        )
    if scheme == "http" and not allow_http:
        raise ConfigError(
            f"{where} {label}: plain http is refused: rows fetched in clear text can be altered on the way, and they "
            "become the model's weights. Serve it over https (a self-signed CA: REQUESTS_CA_BUNDLE or SSL_CERT_FILE), "
            "read it as s3:// from an S3-compatible store (AWS_ENDPOINT_URL), or pass --allow-http"
        )
    if not parts.hostname:
        raise ConfigError(f"{where} {label}: no host in the URL; expected https://host/path/file.jsonl")
    name = unquote(parts.path.rsplit("/", 1)[-1])
    if not name.lower().endswith(DATA_SUFFIXES):
        raise ConfigError(
            f"{where} {label}: the URL's path must end in a data file name ({', '.join(DATA_SUFFIXES)}); "
            f"got {name or '(no file name)'!r}"
        )
    return RemoteSpec(scheme=scheme, url=url, label=label)


def _parse_s3(url: str, label: str, where: str) -> RemoteSpec:
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"{where} {label}: {bucket!r} is not an S3 bucket name (3-63 lower-case letters, digits, '.', '-'); "
            "expected s3://bucket/key.jsonl or s3://bucket/prefix/"
        )
    if "?" in key or "#" in key:
        raise ConfigError(f"{where} {label}: an s3:// source takes no query or fragment; name the object or prefix")
    return RemoteSpec(scheme="s3", url=url, label=label, bucket=bucket, key=key)


def fetch(
    remote: RemoteSpec, dest: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_FETCH_BYTES
) -> list[Fetched]:
    """Download ``remote`` into the folder ``dest`` (created); return the files in reading order."""
    folder = Path(dest)
    folder.mkdir(parents=True, exist_ok=True)
    if remote.scheme == "s3":
        return _fetch_s3(remote, folder, max_bytes)
    return [_fetch_https(remote, folder, max_bytes)]


def local_name(index: int, name: str) -> str:
    """The downloaded file's name: its position and suffix only (a remote name is never a local path)."""
    suffix = next(s for s in DATA_SUFFIXES if name.lower().endswith(s))
    return f"{index:06d}{suffix}"


def _check_size(label: str, size: int | None, max_bytes: int, folder: Path) -> None:
    if size is None:
        return
    if size > max_bytes:
        raise DataError(
            f"{label}: {size:,} bytes ({human(size)}), above the fetch limit of {max_bytes:,} bytes "
            f"({human(max_bytes)}); raise --max-fetch-bytes if that is the data, or point at the right file"
        )
    space = free_bytes(folder)
    if space is not None and space[0] < size:
        raise DiskFullError(disk_fault_message(folder, errno.ENOSPC, what=f"the download of {label}", needed=size))


def ssl_context() -> ssl.SSLContext:
    """The system's CAs, or the bundle REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE names (OpenSSL's default paths honour
    SSL_CERT_FILE and SSL_CERT_DIR)."""
    bundle = next((os.environ[v] for v in CA_BUNDLE_VARIABLES if os.environ.get(v)), None)
    if bundle is not None and not Path(bundle).is_file():
        variable = next(v for v in CA_BUNDLE_VARIABLES if os.environ.get(v))
        raise ConfigError(f"{variable}={bundle}: no such CA bundle file; point it at a PEM file of CA certificates")
    return ssl.create_default_context(cafile=bundle)


class _NoDowngrade(urllib.request.HTTPRedirectHandler):
    """Follow redirects (a CDN, a presigned hop), but never from https to plain http."""

    allow_http = False

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: PLR0913 - urllib's signature
        if newurl.lower().startswith("http://") and not self.allow_http:
            raise ConfigError(
                f"{shown_url(req.full_url)}: the server redirects to plain http ({shown_url(newurl)}), which is "
                "refused; fetch from the final https address, or pass --allow-http"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener(allow_http: bool) -> urllib.request.OpenerDirector:
    redirect = _NoDowngrade()
    redirect.allow_http = allow_http
    return urllib.request.build_opener(urllib.request.HTTPSHandler(context=ssl_context()), redirect)


def _fetch_https(remote: RemoteSpec, folder: Path, max_bytes: int) -> Fetched:
    target = folder / local_name(0, unquote(urlsplit(remote.url).path))
    request = urllib.request.Request(
        remote.url, headers={"User-Agent": "kfp-llm-finetune", "Accept-Encoding": "identity"}
    )
    try:
        with _opener(remote.scheme == "http").open(request, timeout=CONNECT_TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            expected = int(length) if length and length.isdigit() else None
            _check_size(remote.label, expected, max_bytes, folder)
            size = _stream_to(response, target, remote.label, max_bytes, expected)
    except urllib.error.HTTPError as exc:
        raise _http_status_error(remote.label, exc.code, exc.reason) from None
    except (urllib.error.URLError, OSError) as exc:
        raise _connection_error(remote.label, exc) from None
    return Fetched(path=target, label=remote.label, size=size)


def _stream_to(response, target: Path, label: str, max_bytes: int, expected: int | None) -> int:
    """Copy the body to ``<target>.part``, bounded; rename it to ``target`` once every byte arrived."""
    part = target.with_name(target.name + ".part")
    size = 0
    try:
        with open(part, "wb") as out:
            while chunk := response.read(CHUNK_BYTES):
                size += len(chunk)
                if size > max_bytes:
                    raise DataError(
                        f"{label}: more than {max_bytes:,} bytes ({human(max_bytes)}) and still sending, above the "
                        "fetch limit; raise --max-fetch-bytes if that is the data, or point at the right file"
                    )
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if expected is not None and size != expected:
            raise TransientError(
                f"{label}: the transfer ended after {size:,} of {expected:,} bytes (the connection was cut); "
                "nothing was kept. Re-run (the pipeline retries exit 200)"
            )
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return size


def _http_status_error(label: str, code: int, reason: Any) -> Exception:
    what = f"{label}: HTTP {code} {reason}"
    if code in _TRANSIENT_HTTP:
        return TransientError(f"{what}: the server is busy or failing; the step exits 200 and is retried")
    if code in (401, 403):
        return DataError(
            f"{what}: access denied. A presigned URL may have expired (make a new one); a private file needs a "
            "URL that grants access, or s3:// with credentials in the environment"
        )
    if code in (404, 410):
        return DataError(f"{what}: no such file on the server; check the URL")
    return DataError(f"{what}: the server refused the download; check the URL")


def _connection_error(label: str, exc: Exception) -> Exception:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ssl.SSLCertVerificationError):
        return ConfigError(
            f"{label}: the server's certificate is not trusted ({reason.verify_message}). A private CA: point "
            "REQUESTS_CA_BUNDLE (or SSL_CERT_FILE) at its PEM bundle"
        )
    if isinstance(exc, ConfigError | DataError | TransientError) or disk_fault(exc) is not None:
        return exc  # a full disk while writing: the prepare step's disk guard makes it one line
    return TransientError(
        f"{label}: the server did not answer ({type(reason).__name__}: {_plain(reason)}); check the host and the "
        "network (HTTPS_PROXY). The step exits 200 and is retried"
    )


def _plain(reason: Any) -> str:
    """A connection error's words without any URL in them (a signed query could ride along)."""
    return re.sub(r"[a-z][a-z0-9+.-]*://\S+", "<url>", str(reason), flags=re.I)


# --- S3 ---------------------------------------------------------------------------------------------------------


def s3_client():
    """A boto3 S3 client configured the usual way (environment, shared config, web identity), with bounded
    timeouts and botocore's standard retries of throttling and 5xx."""
    try:
        import boto3  # optional: boto3
        from botocore.config import Config  # optional: botocore
    except ImportError:
        raise ConfigError(
            "s3:// sources need boto3, which is not installed here: pip install 'kfp-llm-finetune[s3]' "
            "(the trainer image has it)"
        ) from None
    config = Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=CONNECT_TIMEOUT_S,
        retries={"mode": "standard", "max_attempts": 5},
        user_agent_extra="kfp-llm-finetune",
    )
    # botocore reads the region from AWS_DEFAULT_REGION only (botocore 1.44.8 configprovider.py line 60); AWS_REGION,
    # which the other AWS SDKs read and users put in their Secrets, is honoured here
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    return boto3.client("s3", region_name=region, config=config)


def _fetch_s3(remote: RemoteSpec, folder: Path, max_bytes: int) -> list[Fetched]:
    client = s3_client()
    objects = _s3_objects(client, remote, max_bytes)
    _check_size(remote.label, sum(size for _key, size in objects), max_bytes, folder)
    fetched = []
    for index, (key, size) in enumerate(objects):
        label = f"s3://{remote.bucket}/{key}"
        target = folder / local_name(index, key)
        part = target.with_name(target.name + ".part")
        try:
            client.download_file(remote.bucket, key, str(part))
            if part.stat().st_size != size:
                raise TransientError(f"{label}: got {part.stat().st_size:,} of {size:,} bytes; re-run")
            os.replace(part, target)
        except Exception as exc:  # noqa: BLE001 - botocore's errors, told apart by _s3_error
            raise _s3_error(label, exc) from None
        finally:
            part.unlink(missing_ok=True)
        fetched.append(Fetched(path=target, label=label, size=size))
    return fetched


def _s3_objects(client, remote: RemoteSpec, max_bytes: int) -> list[tuple[str, int]]:
    """(key, size) of the object, or of every data object under the prefix in key order."""
    try:
        if not remote.is_prefix:
            head = client.head_object(Bucket=remote.bucket, Key=remote.key)
            return [(remote.key, int(head["ContentLength"]))]
        prefix = remote.key if not remote.key or remote.key.endswith("/") else remote.key + "/"
        objects: list[tuple[str, int]] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=remote.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                objects.extend(_data_object(item["Key"], int(item["Size"]), prefix))
            if len(objects) > MAX_OBJECTS:
                raise DataError(
                    f"{remote.label}: more than {MAX_OBJECTS:,} data objects under the prefix; name a narrower "
                    "prefix, or consolidate the files"
                )
    except (ConfigError, DataError, TransientError):
        raise
    except Exception as exc:  # noqa: BLE001 - botocore's errors, told apart by _s3_error
        raise _s3_error(remote.label, exc) from None
    if not objects:
        raise DataError(
            f"{remote.label}: no {'/'.join(DATA_SUFFIXES)} objects under this prefix; check the bucket and prefix "
            "(s3://bucket/prefix/), or name one object"
        )
    return sorted(objects)


def _data_object(key: str, size: int, prefix: str) -> list[tuple[str, int]]:
    relative = key[len(prefix) :]
    hidden = any(part.startswith(".") for part in relative.split("/"))
    return [(key, size)] if key.lower().endswith(DATA_SUFFIXES) and not hidden else []


_S3_NOT_FOUND = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
_S3_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
              "InvalidToken", "AllAccessDisabled", "AccountProblem"}  # fmt: skip
_S3_TRANSIENT_TYPES = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                       "ProxyConnectionError", "ResponseStreamingError", "IncompleteReadError")  # fmt: skip


def _s3_error(label: str, exc: Exception) -> Exception:
    """One line for what boto3 raised; never the keys (botocore's messages hold none)."""
    if isinstance(exc, ConfigError | DataError | TransientError):
        return exc
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
    kind = type(exc).__name__
    if kind in ("NoCredentialsError", "PartialCredentialsError"):
        return ConfigError(
            f"{label}: no AWS credentials ({kind}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (in the pipeline: "
            "s3_secret=NAME, a Secret with those keys), or give the pod a role (IRSA)"
        )
    if code in _S3_NOT_FOUND:
        return DataError(f"{label}: not found ({code}); check the bucket and key")
    if code in _S3_DENIED:
        return DataError(
            f"{label}: access denied ({code}); check the credentials (the s3_secret's AWS_* keys) and that they "
            "may read this bucket; an S3-compatible store needs AWS_ENDPOINT_URL"
        )
    if kind in _S3_TRANSIENT_TYPES or code.startswith("5") or code in ("SlowDown", "RequestTimeout", "Throttling"):
        return TransientError(
            f"{label}: the object store did not answer ({kind}{': ' + code if code else ''}); check AWS_ENDPOINT_URL "
            "and the network. The step exits 200 and is retried"
        )
    if isinstance(exc, OSError):
        return exc
    return DataError(f"{label}: the download failed ({kind}: {_plain(exc)})")
