"""The deploy step's smoke test behind Kubeflow's Istio mesh (issue 29.5).

KFP starts every pipeline pod with ``sidecar.istio.io/inject: "false"`` (kubeflow/pipelines 2.5.0
``backend/src/apiserver/template/argo_template.go`` 225-230), so the deploy step calls the predictor
without a mesh identity; Kubeflow installs a mesh-wide deny-by-default policy (kubeflow/manifests v1.10.2
``common/istio/istio-install/base/deny_all_authorizationpolicy.yaml``, ``global-deny-all`` in
istio-system) and a profile namespace allows its own identities. Envoy's RBAC filter then answers
403 with the body ``RBAC: access denied``: the smoke test names that cause instead of a bare HTTP 403."""

from __future__ import annotations

import http.server
import threading

import pytest

from llmft.components.lib.serving.inferenceservice import MESH_DENIAL, smoke_test


def _refusing(status: int, body: str):
    def http_get(url, timeout_s):
        return status, body

    def http_post(url, payload, timeout_s):
        return status, body

    return http_get, http_post


def test_an_istio_denial_is_named_with_the_fix():
    get, post = _refusing(403, MESH_DENIAL)
    with pytest.raises(RuntimeError) as caught:
        smoke_test(
            "http://llm.team-a.svc.cluster.local", "demo", "hi", base_name="demo-base", http_get=get, http_post=post
        )
    message = str(caught.value)
    assert "from the Istio mesh" in message and "deployed and Ready" in message
    assert "sidecar.istio.io/inject=false" in message and "Smoke test behind Istio" in message and "\n" not in message


def test_another_403_keeps_the_servers_own_answer():
    get, post = _refusing(403, '{"error": "forbidden by the model server"}')
    with pytest.raises(RuntimeError, match=r"-> HTTP 403: \{\"error\": \"forbidden by the model server\"\}") as caught:
        smoke_test("http://h", "demo", "hi", base_name=None, http_get=get, http_post=post)
    assert "Istio" not in str(caught.value)


class _Envoy403(http.server.BaseHTTPRequestHandler):
    """What Envoy's RBAC filter sends: 403, text/plain, ``RBAC: access denied``."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = MESH_DENIAL.encode()
        self.send_response(403)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_the_real_http_client_reads_envoys_denial():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Envoy403)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="from the Istio mesh"):
            smoke_test(f"http://127.0.0.1:{server.server_port}", "demo", "hi", base_name=None, timeout_s=5)
    finally:
        server.shutdown()
        server.server_close()
