"""A real vLLM OpenAI server on this machine, started as the InferenceService would start it.

``llmft serve check`` and ``serving_deploy_mode=vllm`` (kfp.local) serve what the deploy step's manifest serves:
:func:`vllm_argv` turns the Hugging Face runtime's arguments
(:func:`llmft.components.lib.serving.inferenceservice.server_args`
of the same :class:`ServeSpec`) into the vLLM OpenAI server's, with KServe v0.20's semantics
(``python/huggingfaceserver/huggingfaceserver/__main__.py``):

* ``--model_name=N`` is the served name (``args.model_name``, lines 233-237: ``VLLMModel(args.model_name, ...)``):
  ``--served-model-name N`` here;
* ``--model_dir=D`` is the model vLLM loads (``args.model = args.model_id or args.model_dir``, line 233), a hub
  ``--model_id`` wins over it; ``--model_revision`` becomes vLLM's ``revision`` (line 234);
* ``--backend=vllm`` picks vLLM (lines 60-70; any other backend ignores vLLM flags): required here;
* every other flag is parsed by vLLM's own parser (``maybe_add_vllm_cli_parser`` -> ``make_arg_parser``,
  line 172; its ``FlexibleArgumentParser`` reads ``--max_model_len`` as ``--max-model-len``) and passed
  through unchanged; each ``--lora-modules`` name is also a model of the server (lines 333-336).

Paths under ``/mnt/models`` (where KServe mounts ``storageUri``) are mapped onto the local folder that
``storageUri`` names. The server runs from the serving virtualenv (``make serving-venv``;
``$LLMFT_SERVING_VENV`` overrides its place) on loopback, and is stopped in every case: its process group
gets SIGTERM, then SIGKILL (:class:`VllmServer` is a context manager; Ctrl-C and SIGTERM stop it too).
Everything vLLM refuses (an adapter, the model, the port) is a one-line :class:`VllmRefusedError` carrying
vLLM's own reason, read from its answer or the tail of its log.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llmft
from llmft.components.lib.serving.inferenceservice import MODEL_MOUNT, _urllib_get, smoke_test
from llmft.trainer.errors import EXIT_PREEMPTED, LlmftError, TransientError
from llmft.trainer.io import OWNED_FILE_MARK

SERVING_VENV_ENV = "LLMFT_SERVING_VENV"
SERVING_VENV_DIR = ".venv-serving"
"""The serving virtualenv (``make serving-venv``), in the checkout unless ``$LLMFT_SERVING_VENV`` names one."""
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # else vLLM imports its AVX-512 kernels (vllm._C) and dies with SIGILL on AVX2 CPUs
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for the small models served here
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # shared CI cores: no pinning
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # the InferenceService serves from the volume with HF_HUB_OFFLINE=1 too
    "TOKENIZERS_PARALLELISM": "false",
}
VLLM_SERVE_MODULE = "vllm.entrypoints.cli.main"
"""``python -m vllm.entrypoints.cli.main serve`` is ``vllm serve`` (vLLM's console script) without its shebang."""
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
API_ROOT = "/v1"
"""vLLM's own OpenAI routes (the KServe Hugging Face runtime serves them under /openai/v1)."""
_REASON = re.compile(r"\b((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Exit)): (\S.*)$")


class VllmRefusedError(LlmftError):
    """vLLM refused what it was given (an adapter, the model, its arguments, the port): exit 1, with its reason."""


def serving_venv() -> Path:
    """Where the serving virtualenv is: ``$LLMFT_SERVING_VENV``, else ``.venv-serving`` in the checkout."""
    if os.environ.get(SERVING_VENV_ENV):
        return Path(os.environ[SERVING_VENV_ENV])

    checkout = Path(llmft.__file__).resolve().parent.parent
    return checkout / SERVING_VENV_DIR if (checkout / "setup.cfg").is_file() else Path.cwd() / SERVING_VENV_DIR


def serving_python(venv: Path | None = None) -> Path:
    """The serving virtualenv's python; VllmRefusedError naming ``make serving-venv`` when it is missing."""
    venv = venv or serving_venv()
    python = venv / "bin" / "python"
    if not python.is_file():
        raise VllmRefusedError(
            f"no vLLM serving virtualenv at {venv} ({python} missing): build it with `make serving-venv` "
            f"(or point {SERVING_VENV_ENV} at one)"
        )
    return python


def _runtime_parser() -> argparse.ArgumentParser:
    """The Hugging Face runtime's own flags that decide what vLLM gets (kserve v0.20 huggingfaceserver
    ``__main__.py`` 80-139; ``--model_name`` comes from ``kserve.model_server.parser``, default ``model``)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model_name", default="model")
    parser.add_argument("--model_dir", default=MODEL_MOUNT)
    parser.add_argument("--model_id", default=None)
    parser.add_argument("--model_revision", default=None)
    parser.add_argument("--backend", default="auto")
    return parser


def local_path(path: str, mount_dir: str | Path) -> str:
    """``/mnt/models/x`` -> ``<mount_dir>/x``; any other value unchanged."""
    if path == MODEL_MOUNT or path.startswith(MODEL_MOUNT + "/"):
        return str(Path(mount_dir)) + path[len(MODEL_MOUNT) :]
    return path


def _map_value(arg: str, mount_dir: str | Path) -> str:
    """A passthrough token with the mount mapped: ``/mnt/models/a``, ``name=/mnt/models/a``, ``--x=/mnt/models/a``."""
    head, sep, tail = arg.rpartition("=")
    return f"{head}{sep}{local_path(tail, mount_dir)}" if sep else local_path(arg, mount_dir)


def vllm_argv(runtime_args: Sequence[str], mount_dir: str | Path) -> list[str]:
    """The vLLM OpenAI server's arguments for the Hugging Face runtime's ``runtime_args`` (module docstring)."""
    known, passthrough = _runtime_parser().parse_known_args(list(runtime_args))
    if known.backend != "vllm":
        raise VllmRefusedError(
            f"runtime args {list(runtime_args)}: --backend={known.backend}; only --backend=vllm runs vLLM "
            "(the Hugging Face backend ignores vLLM flags)"
        )
    if known.model_id:
        raise VllmRefusedError(
            f"--model_id={known.model_id}: the base model comes from the hub; this local server runs offline: "
            "put the base model in a local directory (base_model_path) and serve that"
        )
    argv = ["--model", local_path(known.model_dir, mount_dir), "--served-model-name", known.model_name]
    if known.model_revision:
        argv += ["--revision", known.model_revision]
    return argv + [_map_value(a, mount_dir) for a in passthrough]


def mount_dir(storage_uri: str, pvc_name: str, data_root: str | Path) -> Path:
    """The local folder KServe would mount at /mnt/models: ``pvc://<pvc>/<path>`` under ``data_root``."""
    prefix = f"pvc://{pvc_name}"
    if not (storage_uri == prefix or storage_uri.startswith(prefix + "/")):
        raise VllmRefusedError(f"storageUri {storage_uri!r} is not on the PVC {pvc_name!r} mounted at {data_root}")
    return Path(data_root) / storage_uri[len(prefix) :].lstrip("/")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """VllmRefusedError when ``host:port`` cannot be bound (in use): before vLLM spends minutes loading."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise VllmRefusedError(
                f"port {host}:{port} is not free ({exc.strerror or exc}): stop what listens there or choose "
                "another port (--port 0 picks a free one)"
            ) from None


def vllm_reason(log_text: str) -> str:
    """vLLM's own reason from the tail of its log: the last ``SomeError: message`` line, else the last line."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for index in range(len(lines) - 1, -1, -1):
        match = _REASON.search(lines[index])
        if match and not match.group(2).startswith("Traceback"):
            reason = f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"
            detail = next((line for line in lines[index + 1 :] if "Value error, " in line), None)  # pydantic's why
            return f"{reason}: {detail.split('Value error, ', 1)[1]}" if detail else reason
    return lines[-1] if lines else "(no output)"


def _set_parent_death_signal() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The server dies with its launcher even when the launcher is SIGKILLed (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class VllmServer:
    """``with VllmServer(argv) as server:`` a vLLM OpenAI server on loopback, ready; stopped on exit."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        venv: Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | Path | None = None,
        runtime_lora: bool = False,
        startup_timeout_s: float = 900.0,
        print_fn: Callable[[str], Any] = print,
        command: Sequence[str] | None = None,
        stop_grace_s: float = 30.0,
        extra_argv: Sequence[str] = (),
    ):
        self.argv, self.host, self.port = list(argv), host, port
        self.venv, self.runtime_lora, self.startup_timeout_s = venv, runtime_lora, startup_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.print_fn = print_fn
        self.command = list(command) if command else None  # tests: a stand-in for the vLLM module
        self.stop_grace_s = stop_grace_s
        self.extra_argv = list(extra_argv)  # flags of this local run only, e.g. --enforce-eager (never the manifest's)
        self.process: subprocess.Popen | None = None
        self._old_sigterm: Any = None
        self._own_log = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> VllmServer:
        self._trap_sigterm()
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.stop()
        if exc_type is None and self._own_log and self.log_path:  # a temporary log is kept only to read a failure
            self.log_path.unlink(missing_ok=True)

    def _trap_sigterm(self) -> None:
        """SIGTERM to this process unwinds (exit 143, as llmft/trainer/errors.py EXIT_PREEMPTED), so the server is
        stopped first (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum, frame):
            raise SystemExit(EXIT_PREEMPTED)

        self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def start(self) -> None:
        command = self.command or [str(serving_python(self.venv)), "-m", VLLM_SERVE_MODULE, "serve"]
        if self.port:
            check_port_free(self.host, self.port)
        else:
            self.port = free_port(self.host)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | VLLM_ENV
        if self.runtime_lora:
            env[RUNTIME_LORA_ENV] = "True"
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="llmft-vllm-", suffix=".log")
            os.close(handle)
            self.log_path, self._own_log = Path(name), True
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        full = [*command, "--host", self.host, "--port", str(self.port), *self.argv, *self.extra_argv]
        self.print_fn(f"vllm: starting {' '.join(full)} (log: {self.log_path})")
        with open(self.log_path, "wb") as log:
            log.write(f"{OWNED_FILE_MARK} vLLM server log\n".encode())  # a later --log run may replace it
            log.flush()
            self.process = subprocess.Popen(  # noqa: S603 - our own argv
                full,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal if sys.platform.startswith("linux") else None,  # noqa: PLW1509
            )
        self.wait_ready()

    def log_tail(self, chars: int = 20000) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        with open(self.log_path, "rb") as fh:
            fh.seek(max(0, self.log_path.stat().st_size - chars))
            return fh.read().decode(errors="replace")

    def wait_ready(self, poll_s: float = 2.0) -> None:
        """Until ``GET /v1/models`` answers 200; VllmRefusedError with vLLM's reason when it exits first."""

        deadline = time.monotonic() + self.startup_timeout_s
        assert self.process is not None
        while True:
            code = self.process.poll()
            if code is not None:
                raise VllmRefusedError(
                    f"vLLM did not start (exit {code}): {vllm_reason(self.log_tail())} (full log: {self.log_path})"
                )
            with contextlib.suppress(OSError):
                status, _ = _urllib_get(f"{self.url}{API_ROOT}/models", 5.0)
                if status == 200:
                    self.print_fn(f"vllm: ready at {self.url}")
                    return
            if time.monotonic() > deadline:
                raise TransientError(
                    f"vLLM at {self.url} not ready after {self.startup_timeout_s:.0f}s: a slow or busy machine "
                    f"(last log line: {vllm_reason(self.log_tail())}; full log: {self.log_path})"
                )
            time.sleep(poll_s)

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``stop_grace_s``; idempotent."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            for sig, wait in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                try:
                    process.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if process is not None:  # the engine's own children, if any outlived the leader
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def load_adapter(self, name: str, path: str | Path, timeout_s: float = 300.0) -> None:
        """``POST /v1/load_lora_adapter`` (a server with ``runtime_lora``); VllmRefusedError with vLLM's answer."""
        status, body = _post(f"{self.url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout_s)
        if status != 200:
            raise VllmRefusedError(f"vLLM refused the adapter {path} as {name!r} (HTTP {status}): {_message(body)}")


def _post(url: str, payload: dict, timeout_s: float) -> tuple[int, Any]:
    """POST JSON; (status, the answer as JSON, or as text: vLLM answers a loaded adapter in plain text)."""

    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - loopback http
            status, text = response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _message(body: Any) -> str:
    """The error message of a vLLM error answer, on one line."""
    if isinstance(body, dict):
        error = body.get("error")
        inner: dict = error if isinstance(error, dict) else body
        body = inner.get("message") or inner.get("detail") or body
    return " ".join(str(body).split())


def manifest_argv(isvc: dict, pvc_name: str, data_root: str | Path) -> list[str]:
    """vLLM's arguments for the InferenceService manifest ``isvc`` (its predictor's args and storageUri)."""
    model = isvc["spec"]["predictor"]["model"]
    return vllm_argv(model.get("args") or [], mount_dir(model["storageUri"], pvc_name, data_root))


def serve_and_check(
    isvc: dict,
    names: Sequence[str],
    prompts: Sequence[str],
    *,
    pvc_name: str,
    data_root: str | Path,
    max_tokens: int = 32,
    **server_kwargs,
) -> dict[str, Any]:
    """Serve the manifest's model(s) with a real vLLM, run the deploy step's smoke test (the base's name,
    or the merged model's, listed; each name in ``names`` = ``served_models(spec)`` answers under its own name;
    the adapter's greedy chat answer is not the base's) for each
    prompt, stop the server. Returns ``{"models", "answers": {name: text} (first prompt), "samples", "argv"}``."""

    argv = manifest_argv(isvc, pvc_name, data_root)
    adapter, base = names[-1], (names[0] if len(names) == 2 else None)
    samples, models = [], []
    with VllmServer(argv, **server_kwargs) as server:
        for prompt in prompts:
            try:
                smoke = smoke_test(
                    server.url, adapter, prompt, base_name=base, api_root=API_ROOT, chat=True, max_tokens=max_tokens
                )
            except RuntimeError as exc:
                raise VllmRefusedError(f"vLLM smoke test failed: {' '.join(str(exc).split())}") from None
            models = smoke["models"]
            answers = {adapter: smoke["text"]} | ({base: smoke["base_text"]} if base else {})
            # base/adapter: the keys of the local deploy mode's samples (the run summary reads them); None: merged form
            samples.append({"prompt": prompt, "answers": answers, "base": smoke["base_text"], "adapter": smoke["text"]})
    return {"models": models, "answers": samples[0]["answers"], "samples": samples, "argv": argv}
