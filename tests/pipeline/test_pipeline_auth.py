"""`llmft pipeline submit|schedule` from a workstation behind Kubeflow's auth
proxy. The real kfp.Client talks HTTP to a fake KFP API behind a fake proxy that admits a bearer
token or a session cookie (no KFP server can run here); secrets come from a variable or a file,
never from the command line, and are never printed."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmft.cli import main

TOKEN = "eyJhbGciOiJSUzI1NiJ9.fake-token-for-tests"
COOKIE = "oauth2_proxy_kubeflow=fake-session-cookie"


@pytest.fixture
def kfp_behind_proxy(monkeypatch, tmp_path):
    """(url, requests seen): the KFP v2beta1 API calls submit and schedule make, behind a proxy that
    answers 401 unless the request carries the token or the cookie."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            seen.append({"method": self.command, "path": self.path, "headers": headers, "body": body})
            allowed = self.headers.get("Authorization") == f"Bearer {TOKEN}" or self.headers.get("Cookie") == COOKIE
            if not allowed:
                status, reply = 401, {"error": "unauthenticated"}
            elif "/experiments" in self.path:
                status, reply = 200, ({"experiments": []} if self.command == "GET" else {"experiment_id": "exp-1"})
            else:
                status, reply = 200, {"run_id": "run-9", "recurring_run_id": "rr-9"}
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HOME", str(tmp_path))  # no kfp context file of this machine
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def _submit(url: str, *auth: str) -> int:
    return main(["pipeline", "submit", "--host", url, "--namespace", "team-a", *auth, "serving_deploy=false"])


@pytest.mark.slow
def test_a_token_from_a_file_authenticates_every_call_and_is_never_printed(kfp_behind_proxy, tmp_path, capsys):
    url, seen = kfp_behind_proxy
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert _submit(url, "--token-file", str(token_file)) == 0
    assert [r["path"].split("?")[0] for r in seen] == [
        "/apis/v2beta1/experiments",
        "/apis/v2beta1/experiments",
        "/apis/v2beta1/runs",
    ]
    assert all(r["headers"]["authorization"] == f"Bearer {TOKEN}" for r in seen)
    out = capsys.readouterr()
    assert "submitted run run-9" in out.out and TOKEN not in out.out + out.err


@pytest.mark.slow
def test_a_token_or_a_cookie_from_an_environment_variable(kfp_behind_proxy, monkeypatch, capsys):
    url, seen = kfp_behind_proxy
    monkeypatch.setenv("KF_TOKEN", TOKEN)
    monkeypatch.setenv("KF_COOKIE", COOKIE)
    assert _submit(url, "--token-env", "KF_TOKEN") == 0
    assert _submit(url, "--cookie-env", "KF_COOKIE") == 0
    cookie_calls = seen[3:]
    assert cookie_calls and all(r["headers"].get("cookie") == COOKIE for r in cookie_calls)
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err and COOKIE not in out.out + out.err


@pytest.mark.slow
def test_schedule_with_the_pipelines_service_account_token(kfp_behind_proxy, monkeypatch, tmp_path):
    url, seen = kfp_behind_proxy
    path = tmp_path / "sa-token"
    path.write_text(TOKEN)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(path))
    args = ["pipeline", "schedule", "--host", url, "--namespace", "team-a", "--sa-token", "--cron", "0 0 3 * * *"]
    assert main(args) == 0
    assert seen[-1]["path"] == "/apis/v2beta1/recurringruns"
    assert all(r["headers"]["authorization"] == f"Bearer {TOKEN}" for r in seen)


@pytest.mark.slow
def test_no_credentials_behind_the_proxy_is_one_line_naming_the_options(kfp_behind_proxy, capsys):
    url, _ = kfp_behind_proxy
    assert _submit(url) == 1
    err = capsys.readouterr().err.strip()
    assert "HTTP 401" in err and "--token-file" in err and "--cookie-env" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_a_missing_secret_source_names_the_flag_not_a_value(kfp_behind_proxy, monkeypatch, tmp_path, capsys):
    url, seen = kfp_behind_proxy
    monkeypatch.delenv("KF_TOKEN", raising=False)
    assert _submit(url, "--token-env", "KF_TOKEN") == 1
    assert "--token-env KF_TOKEN: the environment variable KF_TOKEN is empty or not set" in capsys.readouterr().err
    assert _submit(url, "--token-file", str(tmp_path / "absent")) == 1
    assert "--token-file" in capsys.readouterr().err
    assert not seen, "nothing reached the server"


def test_a_secret_on_the_command_line_is_not_an_option(capsys):
    with pytest.raises(SystemExit) as usage:
        main(["pipeline", "submit", "--host", "http://kfp", "--token", TOKEN])
    assert usage.value.code == 2
