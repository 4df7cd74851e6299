"""Langfuse: where a training run is watched while it runs, and the one client every step shares.

Used only when ``LANGFUSE_PUBLIC_KEY`` and ``LANGFUSE_SECRET_KEY`` are set (:func:`configured`);
``LANGFUSE_HOST`` (or ``LANGFUSE_BASE_URL``) names the server. Unconfigured, nothing here imports
the SDK and nothing touches the network. The SDK calls used are the ones Langfuse 3.15 through 5.x
share: ``get_client``, ``create_trace_id(seed=)``, ``start_observation(trace_context=)``,
``span.create_event``, ``create_score``, ``propagate_attributes``, ``flush``.

**One trace per training run** (:class:`RunTrace`). Its id is ``create_trace_id(seed="llmft-train/<run
id>")``: the run id is the trainer's (llmft/trainer/rundir.py), kept in every checkpoint's state, so a
preempted run that resumes, in another process or pod, writes into the same trace. Each process
start opens a span (``train`` or ``resume at step N``; input: the config) that every later
observation of that process hangs under:

- an event ``step N`` at every log step (loss, lr, grad_norm, tokens_per_s, ...);
- an event ``eval step N`` at every evaluation and ``checkpoint step-N`` at every committed save;
- ``stopped`` (exit code, a warning) when the process ends early (preemption, Ctrl-C, an error);
- at the end a span ``finished`` whose output is the final metrics, and trace scores
  ``eval_loss``, ``perplexity`` and ``train_loss`` (score ids fixed by the trace, so a retry updates
  them instead of adding more).

Cost: creating and ending a span queues it; the SDK's background thread exports batches (OTLP/HTTP,
every ``LANGFUSE_FLUSH_INTERVAL`` seconds or 512 spans), so a step never waits on the network. A
failing server costs warnings from that thread, never the run: any error here switches the sink
off with one warning. ``langfuse.json`` in the run directory records the trace id for the
evaluate and register steps, which link the adapter comparison and the MLflow version to it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from llmft.trainer.errors import EXIT_CODE_MEANINGS, DataError, TransientError
from llmft.trainer.io import atomic_write_json

log = logging.getLogger("trainer")

KEY_VARIABLES = ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY")
DEFAULT_HOST = "https://cloud.langfuse.com"
RUN_RECORD = "langfuse.json"
"""Written by rank 0 into the run directory: ``{"trace_id", "run_id", "run_name", "host"}``."""
TRACE_SEED_PREFIX = "llmft-train/"
FINAL_SCORES = ("eval_loss", "perplexity", "train_loss")


def configured(environ: dict | None = None) -> bool:
    """Both Langfuse keys are set (the SDK needs nothing else; the host defaults to Langfuse Cloud)."""
    env = os.environ if environ is None else environ
    return all(env.get(name) for name in KEY_VARIABLES)


def host(environ: dict | None = None) -> str:
    """The server the SDK talks to, as the SDK picks it (``LANGFUSE_BASE_URL`` first)."""
    env = os.environ if environ is None else environ
    return (env.get("LANGFUSE_BASE_URL") or env.get("LANGFUSE_HOST") or DEFAULT_HOST).rstrip("/")


def get_client():
    """The process's Langfuse client (the SDK keeps one per public key). Imports the SDK."""
    # heavy: langfuse
    from langfuse import get_client as sdk_client

    return sdk_client()


def seeded_id(seed: str) -> str:
    """``Langfuse.create_trace_id(seed=seed)`` without importing the SDK: the first 16 bytes of the
    seed's SHA-256 as 32 hex characters (langfuse/_client/client.py ``create_trace_id``, 3.15 to 5.x)."""
    return hashlib.sha256(seed.encode("utf-8")).digest()[:16].hex()


def run_trace_id(run_id: str) -> str:
    """The trace id of the training run ``run_id``: the same for every start of the run."""
    return seeded_id(TRACE_SEED_PREFIX + run_id)


def read_run_record(run_dir: str | os.PathLike) -> dict | None:
    """``langfuse.json`` of a run directory, or None (no Langfuse, or not written)."""
    try:
        record = json.loads((Path(run_dir) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("trace_id") else None


def finite(values: dict) -> dict:
    """Numbers of ``values`` as JSON can carry them (NaN and infinities become None)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[key] = float(value) if math.isfinite(value) else None
    return out


class RunTrace:
    """The live trace of one training run, as seen by one process (rank 0)."""

    def __init__(self, client, trace_id: str, *, run_name: str, run_id: str):
        self.client, self.trace_id, self.run_name, self.run_id = client, trace_id, run_name, run_id
        self.start_span: Any = None  # the run's Langfuse span once opened
        self.enabled = True

    @classmethod
    def open(
        cls,
        output_dir: Path,
        *,
        run_id: str,
        run_name: str,
        start_step: int,
        total_steps: int,
        config: dict,
        links: dict,
    ) -> RunTrace | None:
        """Open (or, on a resume, continue) the run's trace; None when Langfuse is not configured."""
        if not configured():
            return None
        trace_id = run_trace_id(run_id)
        try:
            trace = cls(get_client(), trace_id, run_name=run_name, run_id=run_id)
            name = f"resume at step {start_step}" if start_step else "train"
            metadata = {"start_step": start_step, "total_steps": total_steps, "pid": os.getpid(), **links}
            trace.start_span = trace._emit(
                lambda c: c.start_observation(
                    trace_context={"trace_id": trace_id}, name=name, as_type="span", input=config, metadata=metadata
                )
            )
            trace.start_span.end()
        except Exception as exc:  # noqa: BLE001 - observability must never stop training
            log.warning("langfuse disabled: %s", exc)
            return None

        record = {"trace_id": trace_id, "run_id": run_id, "run_name": run_name, "host": host()}
        atomic_write_json(Path(output_dir) / RUN_RECORD, record)
        return trace

    def _emit(self, make):
        """Call ``make(client)`` with the trace's name, session and tags on what it creates."""
        with run_trace_attributes(self.run_name, self.run_id):
            return make(self.client)

    def _event(self, name: str, *, output=None, metadata=None, level=None, status_message=None) -> None:
        if not self.enabled:
            return
        try:
            self._emit(
                lambda c: self.start_span.create_event(
                    name=name, output=output, metadata=metadata, level=level, status_message=status_message
                )
            )
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)

    def log_step(self, step: int, metrics: dict) -> None:
        self._event(f"step {step}", output=finite(metrics), metadata={"step": step, "kind": "train"})

    def evaluated(self, step: int, metrics: dict) -> None:
        self._event(f"eval step {step}", output=finite(metrics), metadata={"step": step, "kind": "eval"})

    def checkpoint(self, step: int, path: str) -> None:
        self._event(f"checkpoint step-{step}", metadata={"step": step, "kind": "checkpoint", "path": path})

    def stopped(self, exit_code: int | None) -> None:
        """The process ends before the run does (SIGTERM/SIGINT with a checkpoint, or an error)."""

        meaning = EXIT_CODE_MEANINGS.get(exit_code, "ended early") if exit_code is not None else "ended early"
        self._event(
            "stopped",
            metadata={"kind": "stopped", "exit_code": exit_code},
            level="WARNING",
            status_message=f"exit {exit_code}: {meaning}",
        )
        self.flush()

    def finish(self, summary: dict) -> None:
        """Close the run: a ``finished`` span whose output is the final metrics, and the trace scores."""
        if not self.enabled:
            return
        final = finite(summary.get("final_metrics") or {})
        try:
            span = self._emit(
                lambda c: c.start_observation(
                    trace_context={"trace_id": self.trace_id},
                    name="finished",
                    as_type="span",
                    output=final,
                    metadata={
                        "steps": summary.get("steps"),
                        "tokens_seen": summary.get("tokens_seen"),
                        "best": summary.get("best"),
                        "speed": summary.get("speed"),
                        "final_dir": summary.get("final_dir"),
                    },
                )
            )
            span.end()
            for name in FINAL_SCORES:
                if final.get(name) is not None:
                    self.client.create_score(
                        name=name,
                        value=final[name],
                        trace_id=self.trace_id,
                        score_id=seeded_id(f"{self.trace_id}/{name}"),
                    )
        except Exception as exc:  # noqa: BLE001
            self._disable(exc)
        self.flush()

    def flush(self) -> None:
        """Export what is queued (at the end of a process: the SDK's threads die with it)."""
        try:
            self.client.flush()
        except Exception as exc:  # noqa: BLE001
            log.warning("langfuse flush failed: %s", exc)

    def _disable(self, exc: Exception) -> None:
        self.enabled = False
        log.warning("langfuse disabled after an error: %s", exc)


def run_trace_attributes(run_name: str, run_id: str):
    """Context in which new observations carry the training trace's name, session, tags and run id
    (a root observation, as every one made with ``trace_context`` is, would otherwise rename the trace)."""
    # heavy: langfuse
    from langfuse import propagate_attributes

    return propagate_attributes(
        trace_name=f"llmft-train {run_name}"[:200],
        session_id=run_name[:200],
        tags=["llmft", "train"],
        metadata={"run_id": run_id[:200]},
    )


def add_to_run_trace(client, record: dict, name: str, metadata: dict) -> None:
    """An event in the training trace described by ``record`` (a run directory's ``langfuse.json``),
    from another step (evaluate, register)."""
    with run_trace_attributes(record.get("run_name", ""), record.get("run_id", "")):
        client.create_event(trace_context={"trace_id": record["trace_id"]}, name=name, metadata=metadata)


def dataset_rows(name: str) -> list[tuple[str, Any]]:
    """``[(item id, canonical row)]`` of the ACTIVE items of the Langfuse dataset ``name``, in the
    server's order. Raises DataError (no such dataset, no keys) or TransientError (server trouble)."""

    spec = f"langfuse://{name}"
    if not configured():
        raise DataError(
            f"{spec}: LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY are not set. Export them and LANGFUSE_HOST (in "
            "the pipeline: the Secret named by langfuse_secret) to read a Langfuse dataset"
        )
    client = (
        get_client()
    )  # outside the try: a missing SDK is this install's (exit 1 naming the extra), not the server's
    try:
        dataset = client.get_dataset(name)
    except Exception as exc:  # noqa: BLE001 - the SDK raises its API errors and httpx errors
        status = getattr(exc, "status_code", None)
        if status == 404:
            raise DataError(f"{spec}: no dataset named {name!r} on {host()}; check the name in Langfuse") from None
        if status in (401, 403):
            raise DataError(f"{spec}: {host()} refused the Langfuse keys (HTTP {status}); check them") from None
        raise TransientError(f"{spec}: cannot read the dataset from {host()}: {type(exc).__name__}: {exc}") from None
    return [(item.id, item_row(item)) for item in dataset.items if _active(item)]


def _active(item) -> bool:
    status = getattr(item, "status", "ACTIVE")
    return str(getattr(status, "value", status)).upper() != "ARCHIVED"


def item_row(item) -> dict:
    """A dataset item as a row of the canonical messages schema, for prepare to validate.

    ``input``: a list of chat messages, an object with ``messages``, a string (one user turn) or
    an object with one of ``prompt``/``question``/``query``/``instruction``/``input`` (a string).
    ``expected_output``: a string, a message (``{"role", "content"}`` or ``{"content"}``) or a list of
    messages; it becomes the assistant turn(s). Anything else is passed on as it is, so prepare
    rejects the row with the reason (no assistant turn, wrong type, no known format)."""
    messages = _input_messages(item.input)
    if messages is None:
        return {"input": item.input, "expected_output": item.expected_output}
    return {"messages": [*messages, *_answer_messages(item.expected_output)]}


_PROMPT_KEYS = ("prompt", "question", "query", "instruction", "input")


def _input_messages(value) -> list | None:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        if isinstance(value.get("messages"), list):
            return list(value["messages"])
        texts = [value[k] for k in _PROMPT_KEYS if isinstance(value.get(k), str)]
        if len(texts) == 1:
            return [{"role": "user", "content": texts[0]}]
    return None


def _answer_messages(value) -> list:
    if value is None:
        return []
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict) and "content" in value:
        return [{"role": value.get("role", "assistant"), "content": value["content"]}]
    return [{"role": "assistant", "content": value}]
