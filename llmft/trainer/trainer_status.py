"""Kubeflow Trainer's progress API: rank 0 posts progress, ETA and metrics into ``TrainJob.status.trainerStatus``.

From Kubeflow Trainer v2.2 (feature gate ``TrainJobStatus``) the TrainJobStatus runtime plugin injects three
variables into every trainer container (kubeflow/trainer v2.3.0
``pkg/runtime/framework/plugins/trainjobstatus/trainjobstatus.go`` 42-46, 118-137; the same in v2.2.0):

* ``KUBEFLOW_TRAINER_SERVER_URL``: ``https://<webhook service>.<operator namespace>.svc:<port>`` + the path
  ``/apis/trainer.kubeflow.org/v1alpha1/namespaces/<ns>/trainjobs/<name>/status``
  (``pkg/statusserver/utils.go`` 31-34);
* ``KUBEFLOW_TRAINER_SERVER_CA_CERT``: the *path* of the CA certificate (a projected ConfigMap);
* ``KUBEFLOW_TRAINER_SERVER_TOKEN``: the *path* of a projected service-account token (audience
  ``trainer.kubeflow.org/v1alpha1/namespaces/<ns>/trainjobs/<name>/status``, expiry 3600 s: it rotates, so it
  is re-read, as docs/user-guides/trainjob-progress.md asks).

The server (``pkg/statusserver/server.go`` 136-206) takes ``POST`` with ``Authorization: Bearer <token>``
(``auth.go`` ``extractRawToken``: exactly two fields, the scheme case-insensitive), a body of at most 64 KiB
(``maxBodySize``) decoded into ``UpdateTrainJobStatusRequest`` =
``{"trainerStatus": {"progressPercentage", "estimatedRemainingSeconds", "metrics": [{"name", "value"}],
"lastUpdatedTime"}}`` (``pkg/apis/trainer/v1alpha1/trainjob_types.go`` 561-620: percentage int32 0..100,
seconds int32 >= 0, at most 256 metrics whose name and value are strings of 1-64 characters,
``lastUpdatedTime`` an RFC 3339 time, required) and server-side-applies it to the TrainJob's status;
403 for a bad token, 422 for a payload the decoder or the CRD refuses, 200 with the payload echoed.
The Kubeflow SDK's ``update_trainjob_status`` (kubeflow/sdk, ``kubeflow/trainer/backends/kubernetes/utils.py``)
sends the same body and throttles to one update per 5 s; transformers' ``KubeflowTrainerCallback`` calls it.

Here: rank 0 hands every log step's numbers to :class:`StatusReporter`, which posts the latest on its own
thread at most once per ``MIN_INTERVAL_S`` (the SDK's limit), so a slow or dead server never delays a step;
the last report (100%) is sent when training ends, waiting at most ``CLOSE_TIMEOUT_S``. A failure logs one
warning and reporting goes on (the next report may succeed); training never stops for it. No variable set:
nothing happens. Stdlib only (the trainer image carries no HTTP client of its own).
"""

from __future__ import annotations

import json
import logging
import math
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from datetime import UTC, datetime

from llmft.trainer.progress import Progress

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_CERT_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_S = 5.0
"""At most one POST per this many seconds (the SDK's ``_MIN_UPDATE_INTERVAL_SECONDS``)."""
REQUEST_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 10.0
MAX_METRICS = 256
MAX_TEXT = 64
"""Longest metric name or value the CRD accepts (``maxLength: 64``)."""

log = logging.getLogger("trainer")


def status_body(progress: Progress, metrics: Mapping[str, float], now: datetime | None = None) -> dict:
    """The ``UpdateTrainJobStatusRequest`` for ``progress`` and ``metrics`` (finite numbers only, at most 256)."""
    status: dict = {
        "progressPercentage": max(0, min(100, int(math.floor(progress.percent)))),
        "lastUpdatedTime": (now or datetime.now(UTC)).isoformat(timespec="seconds").replace("+00:00", "Z"),
    }
    if progress.eta_s is not None:
        status["estimatedRemainingSeconds"] = max(0, min(2**31 - 1, int(round(progress.eta_s))))
    listed = [
        {"name": name[:MAX_TEXT], "value": f"{float(value):.6g}"}
        for name, value in metrics.items()
        if name and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ]
    if listed:
        status["metrics"] = listed[:MAX_METRICS]
    return {"trainerStatus": status}


class StatusReporter:
    """Posts the latest status on a background thread, at most once per ``min_interval_s``."""

    def __init__(self, url: str, token_path: str, ca_cert: str | None, *, min_interval_s: float = MIN_INTERVAL_S):
        self.url, self.token_path, self.min_interval_s = url, token_path, min_interval_s
        self.context = ssl.create_default_context(cafile=ca_cert if ca_cert and os.path.isfile(ca_cert) else None)
        self.pending: dict | None = None
        self.sent = 0
        self.failures = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="trainjob-status", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StatusReporter | None:
        """A reporter when the TrainJobStatus plugin injected its variables, else None."""
        env = os.environ if environ is None else environ
        url, token = env.get(URL_ENV, ""), env.get(TOKEN_ENV, "")
        if not url or not token:
            return None
        return cls(url, token, env.get(CA_CERT_ENV) or None)

    def report(self, progress: Progress, metrics: Mapping[str, float]) -> None:
        """Queue the latest status (an unsent older one is replaced); never blocks on the network."""
        with self._cond:
            self.pending = status_body(progress, metrics)
            self._cond.notify()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is pending now (the interval waived), then stop the thread; waits at most ``timeout_s``."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        last = -math.inf
        while True:
            with self._cond:
                while self.pending is None and not self._closing:
                    self._cond.wait()
                wait = self.min_interval_s - (time.monotonic() - last)
                if self.pending is not None and wait > 0 and not self._closing:
                    self._cond.wait(wait)  # a newer report may replace this one meanwhile
                    continue
                body, self.pending = self.pending, None
                closing = self._closing
            if body is not None:
                last = time.monotonic()
                self._post(body)
            if closing:
                return

    def _post(self, body: dict) -> None:
        try:
            with open(self.token_path, encoding="utf-8") as fh:  # re-read: the projected token rotates
                token = fh.read().strip()
            request = urllib.request.Request(
                self.url,
                data=json.dumps(body).encode(),
                method="POST",
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S, context=self.context) as response:
                response.read()
            self.sent += 1
        except (OSError, ValueError) as exc:  # HTTPError, URLError, TLS, timeouts, an unreadable token file
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning("TrainJob progress not reported to %s (%d failure(s)): %s", self.url, self.failures, exc)
