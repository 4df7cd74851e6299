"""What ended a command, as its exit code and the one line the user sees first: the one mapping.

``llmft <group> ...`` (llmft/cli.py) and every trainer rank (``python -m llmft.trainer``,
llmft/trainer/__main__.py) print what :func:`describe_failure` returns; they differ only in the words
of a :class:`Teller` (what a full disk was writing, what a re-run resumes from). The codes are those of
llmft/trainer/errors.py: 1 bad input or a missing package (this install's configuration: a retry
cannot cure it), 200 a transient fault, 130/143 a signal, 3 a bug.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass

from llmft.trainer import errors
from llmft.trainer.mlflow_settings import redact_credentials
from llmft.trainer.storage import describe_disk_fault, describe_path_error, disk_fault, disk_fault_exit_code

DISTRIBUTION = "kfp-llm-finetune"
IMPORT_NAMES = {
    "mlflow-skinny": "mlflow",
    "kfp-kubernetes": "kfp.kubernetes",
    "kubeflow-training": "kubeflow.training",
    "kubernetes-validate": "kubernetes_validate",
    "pyyaml": "yaml",
    "lm-eval": "lm_eval",
}
"""Distributions of setup.cfg's extras whose import name is not their name with ``-`` as ``_``."""


@dataclass(frozen=True)
class Teller:
    """The words :func:`describe_failure` uses for one kind of command."""

    command: str = "this command"  # "llmft data": who needs a missing package
    output: str = "the output"  # what a full disk was writing
    resume: str = ""  # what a re-run resumes from, said after a transient fault
    interrupted: str = "interrupted (Ctrl-C)"  # a KeyboardInterrupt no handler of ours explained
    extras: tuple[str, ...] = ()  # the extras this command's own imports come from (named when no other is known)


def describe_failure(exc: BaseException, teller: Teller = Teller()) -> tuple[int, str]:
    """(exit code, message) for an exception that reached a command line. A user error keeps its lines
    (prepare's rejects, a resume diff); anything else is one line. No credential of a URL is ever shown."""

    code, message = _classify(exc, teller)
    return code, redact_credentials(message)


def _classify(exc: BaseException, teller: Teller) -> tuple[int, str]:
    if isinstance(exc, errors.LlmftError):
        return exc.exit_code, str(exc).strip()
    missing = missing_package(exc, teller)
    if missing is not None:
        return errors.EXIT_USER_ERROR, missing
    if lost_peer(exc):
        return errors.EXIT_TRANSIENT, (
            f"lost a peer rank ({type(exc).__name__}: {one_line(str(exc))[:300]}): another node or rank died "
            "without a checkpoint (OOM kill, lost node, crash); exit 200 so this pod restarts too and every rank "
            "resumes together from the newest complete checkpoint"
        )
    if isinstance(exc, KeyboardInterrupt):  # a SignalStop (SIGTERM: 143) says which signal and what was kept
        return getattr(exc, "exit_code", errors.EXIT_INTERRUPTED), one_line(str(exc)) or teller.interrupted
    disk = describe_disk_fault(exc, teller.output)  # also safetensors' and torch.save's own errors
    if disk is not None:
        return disk_fault_exit_code(disk_fault(exc) or 0), one_line(disk + _resume_note(teller))
    bad_path = describe_path_error(exc)  # a 300-character output path: bad input, not an I/O fault
    if bad_path is not None:
        return errors.EXIT_USER_ERROR, bad_path
    if isinstance(exc, OSError):  # EIO, a permission error, network storage: a re-run may cure it
        where = f"{exc.filename}: " if exc.filename else ""
        what = exc.strerror or str(exc) or type(exc).__name__
        return errors.EXIT_TRANSIENT, one_line(
            f"{where}{what} ({type(exc).__name__}, errno {exc.errno}). An I/O fault (full or read-only disk, "
            f"permissions, network storage): fix it and re-run; exit 200 is retried by the pipeline"
            + _resume_note(teller)
        )
    return errors.EXIT_INTERNAL, one_line(
        f"internal error: {type(exc).__name__}: {exc}. This is a bug; re-run with LLMFT_DEBUG=1 for the traceback "
        "and report it"
    )


def _resume_note(teller: Teller) -> str:
    return f"; {teller.resume}" if teller.resume else ""


def one_line(text: str) -> str:
    return " ".join(text.split())


def missing_package(exc: BaseException, teller: Teller = Teller()) -> str | None:
    """The one line for a package this install lacks (a ModuleNotFoundError of a package outside llmft), naming
    the extra of setup.cfg that brings it; None for anything else (a module of ours missing is a bug)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name or exc.name.split(".")[0] == "llmft":
        return None
    if exc.name.split(".")[0] == "torch":
        fix = (
            "install torch first (`make install` does; for a CUDA build see CONTRIBUTING.md, On a GPU), then "
            f"pip install '{DISTRIBUTION}[trainer]'"
        )
    else:
        extras = _preferred(extras_providing(exc.name), teller.extras) or list(teller.extras)
        fix = (
            f"install the extra it comes with: pip install '{DISTRIBUTION}[{','.join(extras)}]'"
            if extras
            else f"install it: pip install {exc.name.split('.')[0]}"
        )
    return f"{teller.command} needs the Python package {exc.name!r}, which is not installed here; {fix}"


def _preferred(found: list[str], preferred: tuple[str, ...]) -> list[str]:
    """One extra: the first of ``preferred`` that brings the package, else the first that does (``dev`` last)."""
    ranked = [e for e in preferred if e in found] + [e for e in found if e != "dev"] + [e for e in found if e == "dev"]
    return ranked[:1]


def extras_providing(module: str) -> list[str]:
    """The extras of this package's installed metadata (setup.cfg's ``extras_require``) whose requirements
    bring ``module`` (an import name, e.g. ``kfp.kubernetes``), in setup.cfg's order; the extras of a
    distribution named exactly so first, then those of its top-level package."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:  # a source tree without installed metadata
        return []
    exact: list[str] = []
    top: list[str] = []
    for requirement in requirements:
        name = re.match(r"\s*([A-Za-z0-9._-]+)", requirement)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if not name or not extra:
            continue
        dist = name.group(1).lower().replace("_", "-")
        imported = IMPORT_NAMES.get(dist, dist.replace("-", "_"))
        if imported == module:
            exact.append(extra.group(1))
        elif imported == module.split(".")[0]:
            top.append(extra.group(1))
    return list(dict.fromkeys(exact or top))


PEER_LOST_MESSAGES = ("Connection closed by peer", "Connection reset by peer")
"""What gloo's RuntimeError says when another rank's process is gone (third_party/gloo tcp/pair.cc)."""


def lost_peer(exc: BaseException) -> bool:
    """A collective failed because another rank died: torch.distributed's DistError (NCCL, the
    store, the network) or gloo's peer-reset RuntimeError, in a multi-rank run. Such a failure is
    retryable: under restartPolicy ExitCode the surviving pods must exit >= 128 so the operator
    restarts them too, and the whole job resumes from its newest checkpoint (the restart budget in
    llmft/trainer/rundir.py bounds the loop)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or "torch" not in sys.modules:
        return False
    # heavy: torch
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in PEER_LOST_MESSAGES)
