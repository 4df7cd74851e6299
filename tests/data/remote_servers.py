"""Real servers on loopback for the remote-source tests (unique module name: tests/*/ dirs share sys.path).

- :class:`HttpsFiles`: Python's own HTTPS server (``http.server`` + ``ssl``) with a certificate from a CA made in
  the test by trustme; it serves the files put into it and, by path, the failures a real server shows (an
  error status, a transfer cut short, a redirect to plain http, a body larger than announced). The client trusts
  the CA only the way a user would: ``SSL_CERT_FILE`` or ``REQUESTS_CA_BUNDLE`` naming the CA's PEM file.
- :func:`s3_server`: moto's ThreadedMotoServer, a real S3-compatible HTTP server (moto[server], the werkzeug app
  behind ``moto_server``) that boto3 talks to over the network exactly as it talks to MinIO or AWS, through
  ``AWS_ENDPOINT_URL``; the client is never mocked.
"""

from __future__ import annotations

import json
import ssl
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

QA_ROWS = [{"question": f"What is {i} plus {i}?", "answer": f"{2 * i}", "id": i} for i in range(60)]
"""Rows with the columns of a typical Q&A export: read with --columns prompt:question,completion:answer."""
AWS_TEST_KEYS = {"AWS_ACCESS_KEY_ID": "AKIALLMFTTESTKEY0001", "AWS_SECRET_ACCESS_KEY": "llmft-test-secret-0001/xyz"}


def qa_csv(rows: list[dict] = QA_ROWS) -> bytes:
    lines = ["question,answer,id", *(f'"{r["question"]}",{r["answer"]},{r["id"]}' for r in rows)]
    return ("\n".join(lines) + "\n").encode()


def qa_jsonl(rows: list[dict] = QA_ROWS) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


class HttpsFiles:
    """An HTTPS server on 127.0.0.1 whose certificate a test CA signed. ``files`` maps a path to its bytes;
    ``requests`` records (method, path with query, headers) of every request."""

    def __init__(self, tmp_path: Path):
        import trustme

        self.ca = trustme.CA()
        self.ca_file = tmp_path / "test-ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                owner.requests.append(("GET", self.path, dict(self.headers.items())))
                path = self.path.split("?", 1)[0]
                if path.startswith("/status/"):
                    return self._send(int(path.split("/")[2]), b"no")
                if path.startswith("/redirect-to-http/"):
                    self.send_response(302)
                    self.send_header("Location", f"http://127.0.0.1:9/{path.rsplit('/', 1)[-1]}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                if path.startswith("/cut/"):  # announces the whole body, sends half, closes
                    body = owner.files[path[len("/cut") :]]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return None
                if path.startswith("/unsized/"):  # no Content-Length: the size is learned while reading
                    body = owner.files[path[len("/unsized") :]]
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(body)
                    self.close_connection = True
                    return None
                if path not in owner.files:
                    return self._send(404, b"not found")
                return self._send(200, owner.files[path])

            def _send(self, status: int, body: bytes):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args):
                pass

        return Handler

    def __enter__(self) -> HttpsFiles:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def fresh_bucket(stem: str) -> str:
    """A bucket name no other test uses: moto keeps its buckets in process-wide state, so two servers started in one
    pytest process see each other's objects."""
    return f"{stem}-{uuid.uuid4().hex[:8]}"


@contextmanager
def s3_server() -> Iterator[str]:
    """The endpoint URL of a ThreadedMotoServer on 127.0.0.1 (a free port), stopped at the end."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def s3_env(endpoint: str) -> dict[str, str]:
    """The variables an s3 Secret sets (AWS_* keys, the endpoint of an S3-compatible store, the region), and
    no instance-metadata lookup (botocore would otherwise try 169.254.169.254 when no key is set)."""
    return {
        **AWS_TEST_KEYS,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def put_objects(endpoint: str, bucket: str, objects: dict[str, bytes]) -> None:
    """Create ``bucket`` on the server and upload ``objects`` (key -> bytes) with boto3."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=AWS_TEST_KEYS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=AWS_TEST_KEYS["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket=bucket)
    for key, body in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
