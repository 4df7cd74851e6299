"""`python -m llmft.trainer [--config FILE] [key=value ...]`: what every rank runs.

parse -> build -> train -> close (the run itself is llmft/trainer/train.py). Users and pods run it
through `llmft train` (one process) or `llmft train --nproc N` (torchrun, one process per rank).
Exit codes follow the Training Operator's ExitCode restart policy: 0 done; 1 bad config or data,
too many non-finite steps, or the restart budget spent (permanent); 3 an internal error (a bug,
permanent); 130 Ctrl-C and 143 SIGTERM after committing a checkpoint (143 is retried and the
restarted pod resumes from it); 200 a transient I/O fault (retried).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from llmft.trainer import errors
from llmft.trainer.config_load import config_to_yaml, load_config_checked
from llmft.trainer.errors import EXIT_OK, SignalStop
from llmft.trainer.storage import describe_disk_fault, describe_path_error, disk_fault, disk_fault_exit_code

EPILOG = """examples:
  llmft train --config llmft/trainer/configs/tiny-cpu.yaml data=/data/tok output_dir=/runs/a
  llmft train --nproc 8 --config llmft/trainer/configs/qwen2.5-7b-lora-1xh100.yaml optim.lr=1e-4
exit codes: 0 ok, 1 config/data error or non-finite training, 3 internal error, 130 Ctrl-C and
143 SIGTERM (checkpoint committed), 200 transient I/O fault"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmft.trainer",
        description="LLM fine-tuning trainer (one rank).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file mapping 1:1 onto trainer.config.TrainConfig")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, nested with dots: lora.r=16")
    return parser


def _rank_prefix() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""


def main(argv: list[str] | None = None) -> int:
    # heavy: torch
    from llmft.trainer.distributed import write_rank_exit

    args = build_parser().parse_intermixed_args(argv)  # key=value words before and after the options
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop_while_starting) if main_thread else None  # build() sets its own
    use_expandable_segments()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code = run(args)
    except BaseException as exc:
        if isinstance(exc, SystemExit) or os.environ.get("LLMFT_DEBUG", "") not in ("", "0"):
            raise
        code, message = describe_failure(exc)
        print(f"{_rank_prefix()}error: {message}", file=sys.stderr, flush=True)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    write_rank_exit(code)
    return code


STARTUP_INTERRUPT = (
    "interrupted by Ctrl-C while the trainer was starting (before the model was loaded): stopped at once; "
    "no training step had run, so there is nothing to checkpoint"
)


COMMITTED: dict[str, str] = {}
"""Set (``{"output": ...}``) once the run's output is committed: a stop signal after that stops nothing."""
AFTER_COMMIT = "{name} arrived after the run's output was committed ({output}): nothing to stop or resume; exit 0"


def _stop_while_starting(signum, _frame) -> None:
    """SIGTERM before the trainer's own handlers (imports, config, planning): nothing to checkpoint yet,
    so stop at once with one line and exit 143 (a retried pod simply starts again). After the output was
    committed (the handlers are this one again): a line on stderr, and the run still exits 0."""

    if COMMITTED:
        print(f"[llmft] {AFTER_COMMIT.format(name=signal.Signals(signum).name, **COMMITTED)}", file=sys.stderr)
        return
    raise SignalStop(
        signum,
        "stopped by SIGTERM while the trainer was starting: no training step had run, "
        "so there is nothing to checkpoint; exit 143 (a retried pod starts again)",
    )


def describe_failure(exc: BaseException) -> tuple[int, str]:
    """(exit code, message) for what ended a run: a user error keeps its lines (a resume diff),
    anything else is one line."""

    if isinstance(exc, errors.LlmftError):
        return exc.exit_code, str(exc).strip()
    if lost_peer(exc):
        return errors.EXIT_TRANSIENT, (
            f"lost a peer rank ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}): another node or rank died "
            "without a checkpoint (OOM kill, lost node, crash); exit 200 so this pod restarts too and every rank "
            "resumes together from the newest complete checkpoint"
        )
    if isinstance(exc, KeyboardInterrupt):  # SignalStop says which signals; a bare one came before any handler
        return getattr(exc, "exit_code", errors.EXIT_INTERRUPTED), str(exc).strip() or STARTUP_INTERRUPT
    disk = describe_disk_fault(exc, "the run's output (a checkpoint, final/ or a log)")
    if disk is not None:  # safetensors and torch.save report a full disk as their own errors, not OSError
        return disk_fault_exit_code(
            disk_fault(exc) or 0
        ), disk + "; the run resumes from its newest complete checkpoint"
    bad_path = describe_path_error(exc)  # output_dir too long a name: bad input, not an I/O fault
    if bad_path is not None:
        return errors.EXIT_USER_ERROR, bad_path
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return errors.EXIT_TRANSIENT, (
            f"{where}{exc.strerror or exc} ({type(exc).__name__}). An I/O fault (full or read-only disk, "
            "network storage): fix it and re-run; the run resumes from its newest checkpoint"
        )
    text = " ".join(str(exc).split())
    return errors.EXIT_INTERNAL, (
        f"internal error: {type(exc).__name__}: {text}. This is a bug: re-run with LLMFT_DEBUG=1 for the "
        "traceback and report it"
    )


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


def use_expandable_segments() -> None:
    """Default PyTorch's CUDA allocator to expandable segments (before CUDA starts).

    Packed batches change their token count every step; with fixed-size cached blocks the
    reserved memory grows far past the allocated peak (69 GiB reserved for 48 GiB allocated
    on the 1.5B LoRA benchmark; 47.9 GiB with expandable segments), and a full card makes the
    allocator free its cache and retry. A value the user set (even empty) is kept.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def run(args: argparse.Namespace) -> int:
    """Parse, then one :class:`~llmft.trainer.train.Trainer`: build -> train -> close."""
    cfg, warnings = load_config_checked(args.config, args.overrides)  # validated once
    if args.print_config:
        print(config_to_yaml(cfg), end="")
        return 0
    # heavy: torch
    from llmft.trainer.steps import STOP

    # heavy: torch
    from llmft.trainer.train import Stopped, Trainer

    trainer = Trainer(cfg, warnings)
    code = EXIT_OK
    COMMITTED.clear()
    try:
        trainer.build()
        trainer.train()
        COMMITTED["output"] = f"{cfg.output_dir}/final"
        if STOP.signum:  # it came during the last step or the final save: the run is complete, say so
            print(f"[llmft] {AFTER_COMMIT.format(name=signal.Signals(STOP.signum).name, **COMMITTED)}", file=sys.stderr)
    except Stopped as exc:
        code = exc.exit_code
    except BaseException as exc:
        code = describe_failure(exc)[0]
        raise
    finally:
        trainer.close(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
