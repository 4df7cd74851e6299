"""A recording Langfuse server on 127.0.0.1: the real Langfuse SDK runs against it, unchanged.

No Langfuse server can run here (it needs Postgres, ClickHouse, Redis and S3), so the tests put
this fake at the SDK's HTTP boundary. It answers the routes the project's calls reach, with
bodies the SDK's own pydantic models accept (langfuse 5.0.4: ``langfuse/api/commons/types/
dataset.py``, ``dataset_item.py``, ``projects/types/project.py``, ``dataset_items/types/
paginated_dataset_items.py``), and records every request:

- ``POST /api/public/otel/v1/traces``: the OTLP/HTTP export of spans (protobuf, gzip), decoded
  with opentelemetry-proto into :class:`Span` records (ids as hex, attributes as Python values);
- ``POST /api/public/scores`` (SDK 5: a JSON list, answered 202) and ``POST /api/public/ingestion``
  (SDK 3: ``score-create`` events in a batch): scores;
- ``POST /api/public/v2/datasets``, ``GET /api/public/v2/datasets/<name>``, ``POST`` and ``GET
  /api/public/dataset-items``, ``POST /api/public/dataset-run-items`` (SDK 3's experiment runner);
- ``GET /api/public/projects`` (the SDK resolves the project id for URLs).

What a real server does beyond storing is not simulated: trace and observation rows built from
the spans (``langfuse.internal.as_root`` spans make the trace's name/input/output), experiments
derived from ``langfuse.experiment.*`` span attributes (SDK 5), ingestion delays, auth checks.
"""

from __future__ import annotations

import gzip
import http.server
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

PROJECT_ID = "proj-llmft-test"
_NOW = "2026-01-01T00:00:00.000Z"


@dataclass
class Span:
    """One exported span, as the OTLP request carried it."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    attributes: dict = field(default_factory=dict)

    def attr(self, name: str, default=None):
        return self.attributes.get(name, default)

    @property
    def type(self) -> str | None:
        return self.attr("langfuse.observation.type")

    def json_attr(self, name: str):
        """An attribute the SDK wrote as JSON (input, output, metadata values), decoded."""
        value = self.attributes.get(name)
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value

    @property
    def output(self):
        return self.json_attr("langfuse.observation.output")

    @property
    def input(self):
        return self.json_attr("langfuse.observation.input")

    @property
    def metadata(self) -> dict:
        prefix = "langfuse.observation.metadata."
        return {k[len(prefix) :]: self.json_attr(k) for k in self.attributes if k.startswith(prefix)}


def _any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def decode_otlp(body: bytes) -> list[Span]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource in request.resource_spans:
        for scope in resource.scope_spans:
            for span in scope.spans:
                spans.append(
                    Span(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        attributes={a.key: _any_value(a.value) for a in span.attributes},
                    )
                )
    return spans


class FakeLangfuse:
    """Start with ``with FakeLangfuse() as server:``; ``server.env()`` is what a process needs."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, bytes]] = []  # (method, path, body)
        self.spans: list[Span] = []
        self.scores: list[dict] = []
        self.datasets: dict[str, dict] = {}
        self.items: dict[str, dict] = {}  # id -> item, in insertion order
        self.run_items: list[dict] = []
        self.runs: dict[tuple[str, str], str] = {}  # (dataset id, run name) -> dataset run id
        handler = type("Handler", (_Handler,), {"fake": self})
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeLangfuse:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def env(self, public_key: str | None = None) -> dict[str, str]:
        """LANGFUSE_* for a client of this server (a fresh public key: the SDK keeps one client per key)."""
        return {
            "LANGFUSE_PUBLIC_KEY": public_key or f"pk-lf-{uuid.uuid4().hex[:12]}",
            "LANGFUSE_SECRET_KEY": "sk-lf-test",
            "LANGFUSE_HOST": self.url,
            "LANGFUSE_BASE_URL": self.url,
            "LANGFUSE_FLUSH_INTERVAL": "0.2",
        }

    def add_dataset(self, name: str, items: list[dict]) -> None:
        """A dataset as if curated in the UI: ``items`` of {input, expected_output[, status, id]}."""
        self._create_dataset({"name": name})
        for item in items:
            body = {
                "datasetName": name,
                "input": item.get("input"),
                "expectedOutput": item.get("expected_output"),
                "id": item.get("id"),
                "status": item.get("status", "ACTIVE"),
            }
            self._create_item(body)

    def wait_for(self, predicate, timeout: float = 20.0):
        """Poll until ``predicate(self)`` is truthy (the SDK exports on background threads)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                result = predicate(self)
            if result:
                return result
            time.sleep(0.05)
        raise AssertionError(f"the fake Langfuse server did not receive what was expected within {timeout} s")

    def spans_of(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    # --- the stored objects, as the API returns them

    def _create_dataset(self, body: dict) -> dict:
        name = body["name"]
        if name not in self.datasets:
            self.datasets[name] = {
                "id": f"ds-{uuid.uuid4().hex[:12]}",
                "name": name,
                "description": body.get("description"),
                "metadata": body.get("metadata"),
                "projectId": PROJECT_ID,
                "createdAt": _NOW,
                "updatedAt": _NOW,
            }
        return self.datasets[name]

    def _create_item(self, body: dict) -> dict:
        dataset = self.datasets[body["datasetName"]]
        item_id = body.get("id") or uuid.uuid4().hex
        self.items[item_id] = {
            "id": item_id,
            "status": body.get("status") or "ACTIVE",
            "input": body.get("input"),
            "expectedOutput": body.get("expectedOutput"),
            "metadata": body.get("metadata"),
            "sourceTraceId": body.get("sourceTraceId"),
            "sourceObservationId": body.get("sourceObservationId"),
            "datasetId": dataset["id"],
            "datasetName": dataset["name"],
            "createdAt": _NOW,
            "updatedAt": _NOW,
            "mediaReferences": [],
        }
        return self.items[item_id]

    def items_of(self, name: str) -> list[dict]:
        return [i for i in self.items.values() if i["datasetName"] == name]


class _Handler(http.server.BaseHTTPRequestHandler):
    fake: FakeLangfuse

    def log_message(self, *args):
        pass

    def _reply(self, status: int, payload) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> bytes:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding") == "gzip" or body[:2] == b"\x1f\x8b":
            body = gzip.decompress(body)
        return body

    def do_POST(self):  # noqa: N802 - http.server API
        path, body, fake = urlsplit(self.path).path, self._body(), self.fake
        with fake.lock:
            fake.requests.append(("POST", path, body))
            if path.endswith("/otel/v1/traces"):
                fake.spans.extend(decode_otlp(body))
                return self._reply(200, {})
            payload = json.loads(body or b"{}")
            if path == "/api/public/scores":  # SDK 5: a list of scores, answered 202 (all accepted)
                fake.scores += payload if isinstance(payload, list) else [payload]
                return self._reply(202, {})
            if path == "/api/public/ingestion":
                events = payload.get("batch", [])
                fake.scores += [e["body"] for e in events if e.get("type") == "score-create"]
                return self._reply(
                    207, {"successes": [{"id": e.get("id"), "status": 201} for e in events], "errors": []}
                )
            if path == "/api/public/v2/datasets":
                return self._reply(200, fake._create_dataset(payload))
            if path == "/api/public/dataset-items":
                if payload.get("datasetName") not in fake.datasets:
                    return self._reply(404, {"message": "Dataset not found"})
                return self._reply(200, fake._create_item(payload))
            if path == "/api/public/dataset-run-items":  # SDK 3: the run is upserted by (dataset, run name)
                item = fake.items[payload["datasetItemId"]]
                run_id = fake.runs.setdefault((item["datasetId"], payload["runName"]), f"run-{uuid.uuid4().hex[:12]}")
                fake.run_items.append(payload)
                run = {
                    "datasetRunId": run_id,
                    "datasetRunName": payload["runName"],
                    "createdAt": _NOW,
                    "updatedAt": _NOW,
                }
                return self._reply(200, {"id": uuid.uuid4().hex, **payload, **run})
        self._reply(404, {"message": f"fake Langfuse: no route POST {path}"})

    def do_GET(self):  # noqa: N802 - http.server API
        parts, fake = urlsplit(self.path), self.fake
        path, query = parts.path, parse_qs(parts.query)
        with fake.lock:
            fake.requests.append(("GET", self.path, b""))
            if path == "/api/public/projects":
                org = {"id": "org-1", "name": "llmft"}
                return self._reply(
                    200, {"data": [{"id": PROJECT_ID, "name": "llmft", "organization": org, "metadata": {}}]}
                )
            if path.startswith("/api/public/v2/datasets/"):
                name = unquote(path[len("/api/public/v2/datasets/") :])
                if name not in fake.datasets:
                    return self._reply(404, {"message": "Dataset not found"})
                return self._reply(200, fake.datasets[name])
            if path == "/api/public/dataset-items":
                name = query.get("datasetName", [""])[0]
                page, limit = int(query.get("page", ["1"])[0]), int(query.get("limit", ["50"])[0])
                items = fake.items_of(name)
                pages = max(1, -(-len(items) // limit))
                data = items[(page - 1) * limit : page * limit]
                meta = {"page": page, "limit": limit, "totalItems": len(items), "totalPages": pages}
                return self._reply(200, {"data": data, "meta": meta})
        self._reply(404, {"message": f"fake Langfuse: no route GET {path}"})
