"""A loopback fake of the KFP v2beta1 REST API for `llmft pipeline submit|wait` (unique module name: tests/*/ dirs
share sys.path). No KFP server can run here; the real kfp.Client (kfp 2.17.3) and its kfp_server_api models talk
HTTP to it and deserialize what it answers, so the client's real surface is exercised: the paths
(``/apis/v2beta1/healthz``, ``experiments``, ``runs``, ``runs/{run_id}``) and the JSON of ``V2beta1Run`` (``state``:
a ``V2beta1RuntimeState`` name, ``error``: a ``GoogleRpcStatus``, ``run_details.task_details``:
``V2beta1PipelineTaskDetail`` with ``display_name``, ``state``, ``error``) as kfp_server_api 2.x declares them
(``kfp_server_api/models/v2beta1_run.py``, ``v2beta1_pipeline_task_detail.py``). Each GET of a run answers the next
of ``states`` (the last one repeats); a state of ``503`` answers that HTTP status instead."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RUN_ID = "5c1f0e2a-run-9"


class FakeKfpApi:
    def __init__(self, states: list, *, error: str = "", failed_task: tuple[str, str] | None = None):
        self.states, self.error, self.failed_task = list(states), error, failed_task
        self.reads = 0
        self.requests: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def run_body(self) -> tuple[int, dict]:
        state = self.states[min(self.reads, len(self.states) - 1)]
        self.reads += 1
        if isinstance(state, int):
            return state, {"error": "upstream unavailable"}
        body: dict = {"run_id": RUN_ID, "display_name": "llm-finetune run", "state": state}
        if state in ("FAILED", "CANCELED") and self.error:
            body["error"] = {"code": 2, "message": self.error}
        tasks = [{"display_name": "prepare dataset", "state": "SUCCEEDED"}]
        if self.failed_task and state == "FAILED":
            name, message = self.failed_task
            tasks.append({"display_name": name, "state": "FAILED", "error": {"code": 2, "message": message}})
        body["run_details"] = {"task_details": tasks}
        return 200, body

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                path = self.path.split("?")[0]
                owner.requests.append((self.command, path))
                if "/experiments" in path:
                    status, body = 200, ({"experiments": []} if self.command == "GET" else {"experiment_id": "exp-1"})
                elif self.command == "GET" and path.startswith("/apis/v2beta1/runs/"):
                    status, body = owner.run_body()
                else:
                    status, body = 200, {"run_id": RUN_ID, "state": "PENDING"}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *_):
                pass

        return Handler

    def __enter__(self) -> FakeKfpApi:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()
