"""`llmft train [--config FILE] [--nproc N] [key=value ...]`: run the trainer.

One process runs in this interpreter. ``--nproc N`` (or ``auto``: one per GPU) launches N local
ranks through torchrun: standalone on a workstation, or, inside a PyTorchJob pod, with the
PET_NNODES / PET_NODE_RANK / PET_MASTER_ADDR / PET_MASTER_PORT rendezvous the Training Operator
sets (torchrun reads them itself). Before any rank starts, the config is validated and the run
planned here (llmft/trainer/rundir.py, reading only): a bad config, dataset or output_dir is one line
on stderr, not one per rank plus torchrun's report.

Signals: SIGTERM (preemption) and SIGINT (Ctrl-C) are forwarded to torchrun, which passes them to
the ranks; they commit a checkpoint and exit 143 / 130. torchrun runs in its own session, so a
terminal's Ctrl-C reaches this process only and is forwarded once; a second Ctrl-C stops the
ranks without a checkpoint. Exit code: a rank that failed otherwise (1 bad config or data, 3 a
bug, 200 an I/O fault) wins; else 143 / 130 when this command was signalled; else torchrun's.
(torchrun alone exits 1 on a signal, which the ExitCode restart policy treats as permanent.)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from llmft.trainer.__main__ import main
from llmft.trainer.config_load import config_to_dict, load_config
from llmft.trainer.rank_exits import EXIT_DIR_ENV, read_rank_exits

STOP_CODES = (0, 130, 143)  # a rank that finished, or stopped by a signal after its checkpoint


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (trainer/configs/*.yaml are examples); defaults apply without it")
    parser.add_argument(
        "--nproc",
        default=None,
        help=(
            "local processes (ranks) to launch through torchrun: a number, auto/gpu (one per GPU) or cpu. "
            "Inside a PyTorchJob pod torchrun is always used and reads the PET_* rendezvous"
        ),
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument(
        "--wait",
        action="store_true",
        help="when another run holds output_dir, wait for it to end instead of exiting 1 (= wait_for_output_dir=true)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, nested with dots: lora.r=16 optim.lr=1e-4"
    )
    parser.epilog = (
        "Ctrl-C (SIGINT) finishes the step in flight, commits a checkpoint and exits 130; SIGTERM does the same and "
        "exits 143 (retried; the run resumes). A second Ctrl-C stops at once without a checkpoint."
    )
    parser.set_defaults(func=run)


def trainer_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--config", args.config] if args.config else []
    if args.print_config:
        argv.append("--print-config")
    return argv + list(args.overrides) + (["wait_for_output_dir=true"] if args.wait else [])


def torchrun_command(nproc: str, argv: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The torchrun command line for ``nproc`` local ranks."""
    env = os.environ if env is None else env
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if not (env.get("PET_NNODES") or env.get("PET_MASTER_ADDR")):
        cmd.append("--standalone")  # a single machine: local rendezvous on a free port
    return cmd + ["-m", "llmft.trainer", *argv]


def run(args: argparse.Namespace) -> int:
    in_job = bool(os.environ.get("PET_NNODES") or os.environ.get("PET_MASTER_ADDR"))
    if args.print_config or args.nproc is None or (args.nproc == "1" and not in_job):
        return main(trainer_argv(args))
    if args.nproc not in ("auto", "gpu", "cpu") and not (args.nproc.isdigit() and int(args.nproc) >= 1):
        print(f"llmft train: --nproc must be a positive number, auto, gpu or cpu; got {args.nproc!r}", file=sys.stderr)
        return 2
    preflight(args)
    return launch(torchrun_command(args.nproc, trainer_argv(args)))


def preflight(args: argparse.Namespace) -> None:
    """Validate the config and plan the run before any rank starts (raises LlmftError)."""
    # heavy: torch
    from llmft.trainer.rundir import plan_start

    cfg = load_config(args.config, args.overrides)  # validated once, by the loader
    plan_start(cfg, config_to_dict(cfg))


FORWARDED = (
    "[llmft] {name}: forwarded to the ranks through torchrun; each commits a checkpoint after its step in flight, "
    "then exits (a second Ctrl-C stops at once)"
)


def launch(cmd: list[str]) -> int:
    """Run torchrun in its own session; forward SIGTERM/SIGINT; return :func:`launch_outcome`.

    The forwarding handlers are in place before torchrun exists and stay until it has exited, so no moment is
    left where a signal to this launcher is lost (a handler installed after ``Popen`` left one: the signal
    that came while torchrun started was never forwarded, and the ranks ran on). A signal that came while
    torchrun was being started is recorded and forwarded once it runs; one that came after torchrun exited
    is still counted."""
    exit_dir = tempfile.mkdtemp(prefix="llmft-ranks-")
    got_signal: list[int] = []
    started: list[subprocess.Popen] = []

    def forward(signum, _frame):
        got_signal.append(signum)
        if started:
            _forward(started[0], signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            proc = subprocess.Popen(
                cmd, env={**os.environ, EXIT_DIR_ENV: exit_dir}, start_new_session=True, preexec_fn=_in_the_child
            )
            started.append(proc)
            if got_signal:  # it came while torchrun was being started: torchrun gets it now
                _forward(proc, got_signal[-1])
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)  # runs a handler still pending first (CPython checks before it swaps)
        return launch_outcome(code, read_rank_exits(exit_dir), got_signal)
    finally:
        shutil.rmtree(exit_dir, ignore_errors=True)


def _forward(proc: subprocess.Popen, signum: int) -> None:
    if proc.poll() is None:
        proc.send_signal(signum)
        print(FORWARDED.format(name=signal.Signals(signum).name), file=sys.stderr, flush=True)


def launch_outcome(torchrun_code: int, rank_codes: dict[int, int], signals: list[int]) -> int:
    """The exit code of `llmft train --nproc N`: a failed rank wins over a signal."""
    failed = [code for _, code in sorted(rank_codes.items()) if code not in STOP_CODES]
    if failed:
        return failed[0]
    if signals:
        return 128 + signals[0]
    if torchrun_code == 0:
        return 0
    stopped = [code for code in rank_codes.values() if code in (130, 143)]
    if stopped:  # the ranks were signalled directly (torchrun reports that as a failure)
        return max(stopped)
    return torchrun_code if torchrun_code > 0 else 128 - torchrun_code


_PRCTL = None
try:  # loaded here, not in the forked child (dlopen after fork is unsafe while another thread holds its lock)
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: no parent-death signal
    pass


def _in_the_child() -> None:
    """In the child, before torchrun starts: get SIGTERM when this launcher dies (it runs in its own session, so a
    kill of the launcher's process group would not reach it). Linux only; elsewhere a no-op."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
