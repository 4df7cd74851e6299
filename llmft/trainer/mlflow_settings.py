"""MLflow client settings in one place: short timeouts, few retries, and one reachability check.

MLflow's HTTP client retries a failed request 7 times with exponential backoff (about 4 minutes
against a dead server) and waits up to 120 s per request. A pipeline step that also has a KFP
retry policy multiplies that (register: three attempts, about 13 minutes). Here:

- :func:`configure_mlflow_http` sets ``MLFLOW_HTTP_REQUEST_TIMEOUT``,
  ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR`` and
  ``MLFLOW_HTTP_REQUEST_BACKOFF_JITTER`` to the values below unless the user set them (MLflow
  reads them at every request, ``mlflow/environment_variables.py``);
- :func:`mlflow_unreachable` opens one TCP connection to the tracking server with a
  ``CONNECT_TIMEOUT_S`` timeout: a dead host or port is known in seconds, not minutes (skipped
  when an ``HTTP(S)_PROXY`` applies to the host: the client talks to the proxy then);
- :func:`tracking_uri_without_credentials` moves a ``user:password@`` out of the tracking URI into
  ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``, where MLflow reads credentials at
  every request (``mlflow/utils/credentials.py`` ``read_mlflow_creds``), so MLflow's own lines
  ("View run ... at: URL", printed at run end) and our messages never carry a password (issue 27.2);
- :func:`prepare_mlflow` does the first two, and either raises one clear :class:`TransientError`
  (exit 200: the step's retry policy, not the client, retries) or returns the reason (for a
  caller that goes on without MLflow, like the trainer's metrics sink).

No mlflow import here: the trainer image imports this module.
"""

from __future__ import annotations

import os
import re
import socket
from urllib.parse import unquote, urlsplit
from urllib.request import getproxies_environment, proxy_bypass_environment  # type: ignore[attr-defined]

from llmft.trainer.errors import TransientError

PARENT_RUN_ENV = "LLMFT_MLFLOW_PARENT_RUN_ID"
"""The MLflow run a trainer's run nests under (a sweep's parent run): set by the sweep (llmft/katib/tracking.py,
llmft/components/lib/jobs/katib_sweep.py) on each trial, read by the trainer (llmft/trainer/observe.py)."""

CONNECT_TIMEOUT_S = 5.0
HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",  # seconds per request (MLflow's default: 120)
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",  # (default 7: about 4 minutes against a dead server)
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # waits 1 s, 2 s between the retries (default factor 2)
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "1.0",
}
"""What :func:`configure_mlflow_http` sets where the environment does not already."""


def configure_mlflow_http() -> dict[str, str]:
    """Set the MLflow HTTP client's timeout/retry variables unless already set; return the effective values."""
    for name, value in HTTP_SETTINGS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in HTTP_SETTINGS}


CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def tracking_uri_without_credentials(uri: str | None = None) -> str:
    """The tracking URI for an MLflow client: ``uri`` (default ``MLFLOW_TRACKING_URI``) without its userinfo.

    Call before any MLflow client exists, in every process that talks to MLflow. The user name and
    password move into ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (values already
    exported win, as they win in MLflow's own requests), and ``MLFLOW_TRACKING_URI`` in this process's
    environment is rewritten without them, so child processes (ranks, sweep trials) inherit no
    password inside a URL."""
    clean = _move_credentials(uri) if uri is not None else None  # first: a given URI wins over the variable's
    if env_uri := os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = _move_credentials(env_uri)
    return clean if clean is not None else os.environ.get("MLFLOW_TRACKING_URI", "")


def _move_credentials(uri: str) -> str:
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    for name, value in zip(CREDENTIAL_VARS, (user, password), strict=True):
        if value and not os.environ.get(name):
            os.environ[name] = unquote(value)
    return parts._replace(netloc=hostport).geturl()


def mlflow_unreachable(uri: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why the tracking server at ``uri`` cannot be reached, or None (reachable, or not an HTTP server:
    a local ``file:``/path or database store needs no network)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if _behind_proxy(parts.scheme, parts.hostname):
        return None  # requests goes through the proxy; a direct connection proves nothing
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return None
    except socket.gaierror as exc:
        return f"cannot resolve host {parts.hostname!r} ({exc.strerror or exc})"
    except TimeoutError:
        return f"no answer from {parts.hostname}:{port} within {timeout:g} s"
    except OSError as exc:
        return f"cannot connect to {parts.hostname}:{port} ({exc.strerror or exc})"


def _behind_proxy(scheme: str, host: str) -> bool:
    proxies = getproxies_environment()
    return scheme in proxies and not proxy_bypass_environment(host, proxies)


def prepare_mlflow(uri: str, *, required: bool = True) -> str | None:
    """Configure the MLflow client and check the server once.

    Returns None when the server answers. Otherwise raises :class:`TransientError` (``required``) or
    returns the one-line reason (not ``required``: the caller logs it and goes on without MLflow)."""
    configure_mlflow_http()
    reason = mlflow_unreachable(uri)
    if reason is None:
        return None
    message = (
        f"MLflow tracking server {redact_credentials(uri)} is unreachable: {reason}. Check MLFLOW_TRACKING_URI (the "
        "pipeline parameter mlflow_tracking_uri, or the key of the Secret it mounts for MLflow, e.g. llmft-mlflow) "
        "and that the server runs"
    )
    if required:
        raise TransientError(message + "; the step exits 200 and its retry policy retries it")
    return message


URL_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]+@")
"""The user-info part of any URL in a text (``user:password@``, ``user@``, ``token@``; up to the authority's last
``@``, so a password holding ``@`` is hidden whole): what :func:`redact_credentials` hides."""


def redact_credentials(text: str) -> str:
    """``text`` with the user name and password (or token) of every URL in it replaced by ``***``: the one URL
    redactor, for whatever is logged or shown where a URL may carry them (an error line, a tracking URI, kfp.local's
    dump of a task's inputs)."""
    return URL_USERINFO.sub(r"\1***@", text)
