"""Kubeflow Trainer's TrainJob status server on loopback, over HTTPS, taking what the upstream server takes.

Encoded from kubeflow/trainer v2.3.0 (the same in v2.2.0):

* route: ``POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status``
  (``pkg/statusserver/utils.go`` 31-34, ``server.go`` 87); anything else 404 (``handleDefault``);
* auth: ``Authorization`` split on whitespace must be exactly ``Bearer <token>``, the scheme case-insensitive
  (``auth.go`` ``extractRawToken``), and the token valid for this TrainJob (upstream: an OIDC-verified projected
  service-account token whose audience is the TrainJob's status path; here: equal to the token file's content),
  else 403 ``Forbidden`` (``server.go`` 144-151);
* body: at most 64 KiB (``maxBodySize``, ``middleware.go`` 64-76), decoded by ``encoding/json`` into
  ``UpdateTrainJobStatusRequest`` (``pkg/apis/trainer/v1alpha1/trainjob_types.go`` 561-620): unknown fields are
  ignored, a value of the wrong JSON type (a string for an int32, a fraction for an int32, a number for a
  string) fails the decode; ``lastUpdatedTime`` is a ``metav1.Time``, parsed with ``time.RFC3339``; then the
  status is applied and the API server validates it against the CRD (``../shared/k8s-crds``: percentage 0-100,
  seconds >= 0, at most 256 metrics of 1-64 character names and values, ``lastUpdatedTime`` required by the
  x-kubernetes-validation ``has(self.lastUpdatedTime)``); a decode or validation failure is 422 (``server.go``
  155-160, 172-181); an empty ``trainerStatus`` is 200 without an update;
* 200 echoes the decoded payload; errors are a ``metav1.Status`` JSON (``badRequest``).
"""

from __future__ import annotations

import datetime
import json
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import yaml

MAX_BODY = 1 << 16
PATH = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs/([^/]+)/status$")
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
INT32 = (-(2**31), 2**31 - 1)


def status_path(namespace: str, name: str) -> str:
    return f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"


def trainer_status_schema(crd_dir: Path) -> dict:
    text = (crd_dir / "trainer.kubeflow.org_trainjobs.yaml").read_text()
    crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["trainerStatus"]


class DecodeError(ValueError):
    """What Go's json.Decoder refuses for UpdateTrainJobStatusRequest."""


def _int32(value, field: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or float(value) != int(value):
        raise DecodeError(f"json: cannot unmarshal {value!r} into Go struct field TrainerStatus.{field} of type int32")
    if not INT32[0] <= int(value) <= INT32[1]:
        raise DecodeError(f"json: cannot unmarshal number {value} into Go value of type int32")
    return int(value)


def go_decode(body: bytes) -> dict:
    """The request as encoding/json fills UpdateTrainJobStatusRequest (only its fields; the types checked)."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    if not isinstance(data, dict):
        raise DecodeError("json: cannot unmarshal into Go value of type v1alpha1.UpdateTrainJobStatusRequest")
    status = data.get("trainerStatus")
    if status is None:
        return {}
    if not isinstance(status, dict):
        raise DecodeError("json: cannot unmarshal into Go struct field .trainerStatus of type v1alpha1.TrainerStatus")
    decoded: dict = {}
    for field in ("progressPercentage", "estimatedRemainingSeconds"):
        if (value := _int32(status.get(field), field)) is not None:
            decoded[field] = value
    metrics = status.get("metrics")
    if metrics is not None:
        if not isinstance(metrics, list) or not all(isinstance(m, dict) for m in metrics):
            raise DecodeError("json: cannot unmarshal into Go struct field TrainerStatus.metrics of type []Metric")
        for metric in metrics:
            for key in ("name", "value"):
                if key in metric and metric[key] is not None and not isinstance(metric[key], str):
                    raise DecodeError(f"json: cannot unmarshal into Go struct field Metric.{key} of type string")
        decoded["metrics"] = [{k: m[k] for k in ("name", "value") if m.get(k) is not None} for m in metrics]
    when = status.get("lastUpdatedTime")
    if when is not None:
        if not isinstance(when, str) or not RFC3339.match(when):
            raise DecodeError(f'parsing time "{when}" as "2006-01-02T15:04:05Z07:00": cannot parse')
        datetime.datetime.fromisoformat(when.replace("Z", "+00:00"))  # a real date
        decoded["lastUpdatedTime"] = when
    return {"trainerStatus": decoded}


class StatusServer:
    """The server, started on 127.0.0.1 with a certificate for that address signed by ``ca``."""

    def __init__(self, cert: Path, key: Path, token: str, schema: dict, namespace: str = "team", name: str = "job"):
        self.token, self.schema, self.namespace, self.name = token, schema, namespace, name
        self.accepted: list[dict] = []
        self.refused: list[tuple[int, str]] = []
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.httpd.server_address[1]}{status_path(self.namespace, self.name)}"

    def __enter__(self) -> StatusServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def validate(self, request: dict) -> list[str]:
        """The API server's verdict on the applied status (the CRD's schema and its CEL rule)."""
        status = request["trainerStatus"]
        errors = [e.message for e in jsonschema.Draft7Validator(self.schema).iter_errors(status)]
        return errors + (
            [] if "lastUpdatedTime" in status else ["lastUpdatedTime is required when trainerStatus is present"]
        )

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _fail(self, code: int, message: str, reason: str) -> None:
                server.refused.append((code, message))
                self._reply(code, {"status": "Failure", "message": message, "reason": reason, "code": code})

            def do_GET(self) -> None:
                self._fail(404, "Not found", "NotFound")

            def do_POST(self) -> None:
                found = PATH.match(self.path)
                if found is None or found.groups() != (server.namespace, server.name):
                    return self._fail(404, "Not found", "NotFound")
                parts = (self.headers.get("Authorization") or "").split()
                if len(parts) != 2 or parts[0].lower() != "bearer" or parts[1] != server.token:
                    return self._fail(403, "Forbidden", "Forbidden")
                body = self.rfile.read(min(int(self.headers.get("Content-Length") or 0), MAX_BODY + 1))
                try:
                    if len(body) > MAX_BODY:
                        raise DecodeError("http: request body too large")
                    request = go_decode(body)
                except DecodeError:
                    return self._fail(422, "Invalid payload", "Invalid")
                if not request:
                    return self._reply(200, {})
                if errors := server.validate(request):
                    return self._fail(422, "; ".join(errors), "Invalid")
                server.accepted.append(request)
                self._reply(200, request)

        return Handler


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """(ca.crt, server.crt, server.key): a CA, and a certificate for IP 127.0.0.1 it signed (the cryptography
    package, a dependency of the pipeline extra's clients)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmft test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths
