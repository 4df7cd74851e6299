"""`llmft train [--config FILE] [--nproc N] [key=value ...]`: run the trainer.

One process runs in this interpreter. ``--nproc N`` (or ``auto``: one per GPU)
launches N local ranks through torchrun: standalone on a workstation, or, inside
a PyTorchJob pod, with the PET_NNODES / PET_NODE_RANK / PET_MASTER_ADDR /
PET_MASTER_PORT rendezvous the Training Operator sets (torchrun reads them
itself). SIGTERM is forwarded to torchrun and, when the ranks committed their
checkpoint, this command exits 143 (torchrun alone would exit 1 on a signal,
which the ExitCode restart policy treats as permanent).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

EXIT_PREEMPTED = 143


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
        "overrides", nargs="*", metavar="key=value", help="config overrides, nested with dots: lora.r=16 optim.lr=1e-4"
    )
    parser.set_defaults(func=run)


def trainer_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--config", args.config] if args.config else []
    if args.print_config:
        argv.append("--print-config")
    return argv + list(args.overrides)


def torchrun_command(nproc: str, argv: list[str], env: dict | None = None) -> list[str]:
    """The torchrun command line for ``nproc`` local ranks."""
    env = os.environ if env is None else env
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if not (env.get("PET_NNODES") or env.get("PET_MASTER_ADDR")):
        cmd.append("--standalone")  # a single machine: local rendezvous on a free port
    return cmd + ["-m", "llmft.trainer", *argv]


def run(args: argparse.Namespace) -> int:
    in_job = bool(os.environ.get("PET_NNODES") or os.environ.get("PET_MASTER_ADDR"))
    if args.print_config or args.nproc is None or (args.nproc == "1" and not in_job):
        from llmft.trainer.__main__ import main

        return main(trainer_argv(args))
    if args.nproc not in ("auto", "gpu", "cpu") and not (args.nproc.isdigit() and int(args.nproc) >= 1):
        print(f"llmft train: --nproc must be a positive number, auto, gpu or cpu; got {args.nproc!r}", file=sys.stderr)
        return 2
    return launch(torchrun_command(args.nproc, trainer_argv(args)))


def launch(cmd: list[str]) -> int:
    """Run torchrun; forward SIGTERM/SIGINT; map a preemption to exit 143."""
    proc = subprocess.Popen(cmd)
    got_signal: list[int] = []

    def forward(signum, _frame):
        got_signal.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGTERM in got_signal:
        return EXIT_PREEMPTED
    return code if code >= 0 else 128 - code
